"""Test setup: 8 fake CPU devices, configured before JAX initialises its backend."""

import os
import subprocess
import sys

# XLA's CPU compiler emits each fusion through an MLIR pipeline of its own (its "fusion emitters", the default); with
# them off it writes LLVM IR directly, as it did before them, and compiles the tests' programs in well under half the
# time (backend compile 10.6 -> 4.6 s for a tiled-attention test of test_model.py, 9.4 -> 3.8 s for another; the
# README has the suite's time). It is the CPU compiler's code generation alone: the programs compiled for compile-only
# H100s are not touched. The CPU program's own HLO can differ (in-place dynamic-update-slices that the fusion emitters
# hide inside fusions), and so can the last bit of a sum, so the few tests that read the CPU program's HLO or hold two
# programs equal bit for bit compile as users do: USERS_CPU_CODEGEN among a jit's compiler_options. The test processes
# and the CLI runs they start inherit the flag; ULYSSES_TEST_CPU_OPT=1 compiles as users do. A jaxlib that does not
# know the flag would end the process at its first compile, so it is tried once in a child process; the controller's
# answer is inherited by xdist's workers.
CPU_CODEGEN_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _cpu_codegen_flags():
    if os.environ.get("ULYSSES_TEST_CPU_OPT"):
        return ""
    if "ULYSSES_TEST_XLA_CPU_FLAGS" not in os.environ:
        try:
            env = {**os.environ, "XLA_FLAGS": CPU_CODEGEN_FLAG, "JAX_PLATFORMS": "cpu"}
            probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                                   timeout=300, env=env)
            ok = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        os.environ["ULYSSES_TEST_XLA_CPU_FLAGS"] = CPU_CODEGEN_FLAG if ok else ""
    return os.environ["ULYSSES_TEST_XLA_CPU_FLAGS"]


# a jit's compiler_options override XLA_FLAGS: compiled with XLA's default CPU code generation
CPU_CODEGEN_FLAGS = _cpu_codegen_flags()
USERS_CPU_CODEGEN = {"xla_cpu_use_fusion_emitters": True} if CPU_CODEGEN_FLAGS else {}
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), CPU_CODEGEN_FLAGS,
                                                 "--xla_force_host_platform_device_count=8"]))
# One compilation cache for the processes of a test run (the xdist workers and the CLI subprocesses they start): many
# tests compile the same small programs (the tiny model's step, the CLI's), and compiling is most of a CPU test's
# time. XLA keys an entry by the program, the compile options and the versions, so a hit is the same executable.
# Kept in .jax_cache/ (ignored by git, removed by `make clean`); a fresh clone starts empty.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# With the CUDA plugin installed (the aot extra) on a machine without a GPU, the plugin's start-up check fails and
# it does not register; skipping the check lets it register for compile-only H100 targets (tests marked aot).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Programs compiled for the CPU in the test processes skip LLVM's optimisations (XLA's backend optimisation level 0),
# as FAST_COMPILE does per call in test_model.py, test_ring.py and others: XLA's HLO passes run as usual (the same
# collectives, fusions, buffer assignment and memory figures), only the machine code is unoptimised, and compiling is
# most of a CPU test's time (five of the heaviest test files took 40% less time on 2 cores). Programs compiled for the
# compile-only H100s (tests marked aot) keep the default, and so do the CLI subprocesses the tests start.
# ULYSSES_TEST_CPU_OPT=1 compiles as users do. The hook is on a private JAX function
# (jax._src.compiler.get_compile_options); where it is missing the tests run at the default.
if not os.environ.get("ULYSSES_TEST_CPU_OPT"):
    try:
        from jax._src import compiler as _compiler

        _get_compile_options = _compiler.get_compile_options

        def _cpu_without_llvm_optimisations(*args, backend=None, **kwargs):
            options = _get_compile_options(*args, backend=backend, **kwargs)
            if backend is not None and backend.platform == "cpu":
                options.executable_build_options.debug_options.xla_backend_optimization_level = 0
            return options

        _compiler.get_compile_options = _cpu_without_llvm_optimisations
    except (ImportError, AttributeError):
        pass

from ulysses_jax.plan.targets import INSTALL_HINT, cuda_plugin_installed  # noqa: E402

# Kept out of the default `make test` (run by `make test-slow`) to hold it near 15 minutes on CI's 2 cores (the README
# has its latest time): each repeats coverage that a faster variant in the default suite keeps (another mesh, dtype,
# kernel or jit mode of the same check), or is a smoke run of a benchmark script, a second multi-process run (tests/
# test_hf.py runs two processes too), a second end-to-end CLI run of a path the default suite runs once, or a
# compile-only H100 memory figure of one planner feature; a few are the only check of what their comment names as
# checked in `make test-slow` only. Large grids mark their own cases (pytest.param in the test files: test_ulysses.py,
# test_ring.py, test_ulysses_ring.py, test_ring_window.py, test_window.py, test_attention.py, test_flash_attention.py).
SLOW = frozenset({
    "tests/test_experiments.py::test_benchmark_smoke[bench_train.py]",
    "tests/test_experiments.py::test_benchmark_smoke[bench_attention.py]",
    "tests/test_multiprocess.py::test_two_processes_train_resume_and_continue_on_one",
    "tests/test_multiprocess.py::test_ring_across_two_processes_equals_one",
    # eval reads each process's rows: the two-process data path stays in test_hf.py::test_two_processes_read_half_each_
    # and_export, eval by position on one process in test_eval_position.py
    "tests/test_multiprocess.py::test_eval_on_two_processes_equals_one",
    # the watchdog's one line for a peer stays in test_a_failed_process_ends_the_job_with_one_line[1] (a process that
    # fails); a process killed -9 and found by the heartbeats (either process) in `make test-slow` only
    "tests/test_cluster.py::test_a_lost_process_ends_the_job_with_one_line[0]",
    "tests/test_cluster.py::test_a_lost_process_ends_the_job_with_one_line[1]",
    # the default suite keeps the failure of process 1 (its peer, process 0, hosts the store it writes its mark to)
    "tests/test_cluster.py::test_a_failed_process_ends_the_job_with_one_line[0]",
    # the verdict on a row beyond the bound: test_cli.py::test_the_loop_refuses_a_row_beyond_the_bound_before_its_step;
    # a failure on one process ending both with one line: test_a_failed_process_ends_the_job_with_one_line[1]
    "tests/test_cluster.py::test_a_batch_refused_on_one_process_is_refused_on_every_one",
    # the step's accumulation against the whole batch stays in test_grad_accumulation_adds_in_float32 (4 micro-batches
    # against the float32 whole batch) and test_loss.py::test_gradient_accumulation_normalises_by_tokens
    "tests/test_step.py::test_grad_accumulation_equals_large_batch[fsdp2xsp4]",
    "tests/test_step.py::test_grad_accumulation_equals_large_batch[dp2xfsdp2xsp2]",
    # bfloat16 with accumulation ([bfloat16-2]) stays: the dtypes, shardings and aliasing of the same step
    "tests/test_step.py::test_state_dtypes_and_shardings_unchanged_by_a_step[float32-1]",
    "tests/test_step.py::test_state_dtypes_and_shardings_unchanged_by_a_step[bfloat16-1]",
    # --offload-params stays in test_offloaded_optimizer_equals_the_on_device_one (its third run), mixed layers in the
    # scan in tests/test_model_window.py
    "tests/test_step.py::test_offloaded_params_with_mixed_layers_equal_the_on_device_step[plain]",
    "tests/test_model.py::test_sharded_equals_single_device[fsdp8-gqa-llama3]",
    "tests/test_model.py::test_remat_every_second_layer_same_gradients[full]",
    # remat_every 2 with offload: test_remat_nested_same_gradients (offload, every 2) and the mixed layers' remat
    # every 2 in tests/test_model_window.py
    "tests/test_model.py::test_remat_every_second_layer_same_gradients[offload]",
    # remat='full' against the plain model with the tools: test_tiled_attention_equals_plain[mha-bias-...-xla-full],
    # test_model_window.py's remat every 2, test_lora.py's memory tools; save_matmuls and offload stay here
    "tests/test_model.py::test_remat_policies_same_gradients[full]",
    "tests/test_ulysses.py::test_inputs_in_other_shardings[eager]",
    # padded heads stay in test_matches_reference[sp8-h12-...], Pallas inside Ulysses in [kv-copied]
    "tests/test_ulysses.py::test_pallas_kernel_inside_ulysses[padded]",
    # padded heads with a ring: test_ulysses_ring.py's h6 case (heads not divisible by sp); [gqa-kv-copied-f32] stays
    "tests/test_ring.py::test_ulysses_ring_2d_matches_reference[h12-padded-bf16]",
    # inputs in the ring's token order (the model's way) stay in test_model_ring.py::test_ring2_sp4_equals_single_device
    "tests/test_ulysses_ring.py::test_permuted_inputs_and_output_sharding",
    "tests/test_loss.py::test_tiled_loss_equals_plain[sp4-gqa-llama3]",
    "tests/test_sharding.py::test_same_seed_same_parameters_on_any_mesh",  # test_model: SP=P == SP=1 from the init
    # covered in the default suite by the planner's own tests (test_plan.py) and notebook 01
    "tests/test_notebooks.py::test_notebook_runs[03_plan_a_cluster_run]",
    # trains and evaluates; the same paths run in the default suite by tests/test_eval_tasks_cli.py
    "tests/test_notebooks.py::test_notebook_runs[04_did_the_long_context_take]",
    # train-then-eval and mesh-changing resume are also covered by test_eval_reads_the_run_and_refuses_other_data
    # and test_step.py::test_checkpoint_restores_onto_another_mesh
    "tests/test_cli.py::test_pulse_train_then_eval",
    "tests/test_cli.py::test_resume_onto_another_mesh_from_an_earlier_step",
    # resume bit for bit through the real entry point stays in test_moe_hf.py::test_tiny_moe_trains_on_sft_data_and_
    # resumes_exactly (and a resume with --init-from-hf in test_cli_hf.py), SIGTERM's stop after the step in
    # test_a_signal_stops_after_the_step_and_a_second_one_at_once, a damaged checkpoint in test_step.py
    "tests/test_cli.py::test_signal_and_crash_then_resume_matches_uninterrupted",
    "tests/test_cli.py::test_kill_during_an_asynchronous_checkpoint_then_resume",
    # SP=P == SP=1 of the model stays on fsdp2xsp4 (mha-bias), fsdp4xsp2 (qk-norm) and ZeRO-3 (gqa-llama3); KV heads
    # copied in the model in test_tiled_attention_head_groups_equal_plain[gqa-llama3-sp8-...]
    "tests/test_model.py::test_sharded_equals_single_device[fsdp2xsp4-gqa-llama3]",
    "tests/test_model.py::test_sharded_equals_single_device[sp2-mha-bias]",
    "tests/test_model.py::test_sharded_equals_single_device[sp4-gqa-llama3]",
    "tests/test_model.py::test_sharded_equals_single_device[sp8-gqa-qknorm]",
    # the tiled MLP stays on ZeRO-3 (data x fsdp x sp) and in tests/test_model_window.py, tests/test_lora.py
    "tests/test_model.py::test_tiled_mlp_equals_plain[sp4]",
    "tests/test_model.py::test_tiled_mlp_equals_plain[data2xsp4]",
    # the tiled attention stays on ZeRO-3 (XLA, remat full); with head groups on one device (blockwise, 8 groups
    # sharing KV heads), sp2 (Pallas, the output recomputed) and sp8 (copied KV heads); remat offload in
    # test_remat_policies_same_gradients[offload] and test_remat_nested_same_gradients
    "tests/test_model.py::test_tiled_attention_equals_plain[gqa-qknorm-sp4-blockwise-none]",
    "tests/test_model.py::test_tiled_attention_equals_plain[gqa-llama3-fsdp2xsp4-blockwise-offload]",
    "tests/test_model.py::test_tiled_attention_equals_plain[gqa-llama3-sp8-pallas-none]",
    "tests/test_model.py::test_tiled_attention_equals_plain[gqa-qknorm-data2xsp4-blockwise-none]",
    "tests/test_model.py::test_tiled_attention_head_groups_equal_plain[gqa-llama3-1dev-xla-full-4-True]",
    "tests/test_model.py::test_tiled_attention_head_groups_equal_plain[gqa-qknorm-sp4-blockwise-none-0-True]",
    "tests/test_model.py::test_tiled_attention_head_groups_equal_plain[mha-bias-fsdp2xsp4-blockwise-offload-1-False]",
    "tests/test_model.py::test_tiled_attention_head_groups_equal_plain[gqa-qknorm-data2xfsdp2xsp2-zero3-blockwise-"
    "full-1-True]",
    # mixed local/global layers equal the plain model on sp4 with remat every 2 (XLA kernel); the window in the
    # blockwise kernel under Ulysses in tests/test_window.py; each other tool on uniform layers in tests/test_model.py;
    # the windowed ring in tests/test_ring_window.py and the ring model in tests/test_model_ring.py
    "tests/test_model_window.py::test_memory_tools_equal_plain_with_mixed_layers[sp4-attention_impl]",
    "tests/test_model_window.py::test_memory_tools_equal_plain_with_mixed_layers[fsdp2xsp4-attention_impl]",
    "tests/test_model_window.py::test_memory_tools_equal_plain_with_mixed_layers[fsdp2xsp4-remat]",
    "tests/test_model_window.py::test_memory_tools_equal_plain_with_mixed_layers[sp4-attn_chunk-attn_head_chunk-"
    "attention_impl]",
    "tests/test_model_window.py::test_memory_tools_equal_plain_with_mixed_layers[sp2-attn_chunk-attn_recompute-"
    "attention_impl-remat]",
    "tests/test_model_window.py::test_memory_tools_equal_plain_with_mixed_layers[data2xfsdp2xsp2-zero3-mlp_chunk]",
    "tests/test_model_window.py::test_ring_mesh_equals_plain_with_mixed_layers",
    # Gemma 3's post-norms in the chunks stay in test_gemma_tiled_attention_equals_plain[fsdp2xsp4-...-mlp_chunk=4]
    # (the tiled attention and the tiled MLP, remat)
    "tests/test_model_window.py::test_gemma_tiled_mlp_equals_plain[1dev-]",
    "tests/test_model_window.py::test_gemma_tiled_mlp_equals_plain[fsdp2xsp4-remat]",
    "tests/test_model_window.py::test_gemma_tiled_mlp_equals_plain[data2xfsdp2xsp2-zero3-]",
    "tests/test_model_window.py::test_gemma_tiled_attention_equals_plain[1dev-attn_chunk=8-attention_impl=blockwise]",
    "tests/test_model_window.py::test_gemma_tiled_attention_equals_plain[sp4-attn_chunk=4-attn_head_chunk=1-"
    "attention_impl=blockwise]",
    "tests/test_model_window.py::test_gemma_tiled_attention_equals_plain[data2xfsdp2xsp2-zero3-attn_chunk=8-"
    "attn_head_chunk=2-attention_impl=pallas]",
    # the window in each kernel: test_window_matches_float64 (all three kernels) and the Pallas case here; the
    # blockwise kernel's visited tiles are counted against the formula in test_visited_tiles_count_matches_the_formula
    "tests/test_window.py::test_skipped_tiles_are_never_read[blockwise]",
    # Ulysses with a window stays on fsdp x sp; the windowed ring in tests/test_ring_window.py
    "tests/test_window.py::test_ulysses_attention_with_a_window[('ring', 'sp')-(2, 4)-xla]",
    "tests/test_window.py::test_ulysses_attention_with_a_window[('ring', 'sp')-(4, 2)-blockwise]",
    # float8 on fsdp 2 x sp 4 equals one device exactly in [plain]; the tiled sublayers (each chunk scaled on its
    # own), remat and LoRA with float8 on eight devices are checked in `make test-slow` only
    "tests/test_fp8.py::test_eight_devices_equal_one[remat-mlp_chunk]",
    "tests/test_fp8.py::test_eight_devices_equal_one[attn_chunk-groups]",
    "tests/test_fp8.py::test_eight_devices_equal_one[lora-mlp_chunk]",
    # MoE on fsdp 2 x sp 4 stays in the default suite with the tiled MLP and remat (variant1) and in the parity of
    # tests/test_moe_hf.py (plain, sharded)
    "tests/test_moe.py::test_eight_devices_equal_one[variant0]",
    # attn_keep equals plain remat with the blockwise kernel, offload, remat every 2
    "tests/test_kept_attention.py::test_kept_attention_gives_the_same_loss_and_gradients[blockwise-full-1]",
    "tests/test_kept_attention.py::test_kept_attention_gives_the_same_loss_and_gradients[xla-offload-1]",
    "tests/test_kept_attention.py::test_kept_attention_gives_the_same_loss_and_gradients[pallas-full-2]",
    # remat_every 2 ([2]) stays in the default suite and counts the same forward runs; notebook 01 stays
    "tests/test_kept_attention.py::test_the_compiled_step_runs_attention_forward_once_per_layer[1]",
    "tests/test_notebooks.py::test_notebook_runs[02_model_on_fake_devices]",
    # dropout's masks depend on the token alone (the same on a device's or a chunk's share) in
    # test_dropout_masks_depend_on_the_token_alone; LoRA on any mesh in test_same_loss_and_adapter_gradients_...
    "tests/test_lora.py::test_dropout_drops_the_adapters_inputs_alone_and_is_the_same_on_any_mesh",
    # compile-only H100 memory figures of one planner feature each, Llama-3.1-8B planned at full depth and a second
    # `plan` subprocess writing its JSON; the planner's compile and its JSON stay in test_tiny_train_step_plan, the
    # CLI's plan and its JSON in test_plan_search.py::test_joint_verdict_in_the_json, plan's train_args (with the host
    # optimizer) in test_train_args_compile_the_planned_program[host optimizer]; the search in test_plan_search.py's
    # unit tests
    "tests/test_plan.py::test_llama8b_full_depth_at_32k_on_8_h100s",
    "tests/test_plan.py::test_cli_plan_writes_json",
    # the kernels' registers and spills stay with segment ids at D 64 and 128 (the larger kernels of the same head dims)
    # and float32 at D 128 (the larger shared memory)
    "tests/test_gpu_compile_kernels.py::test_bf16_kernels_compile_without_spills[d64]",
    "tests/test_gpu_compile_kernels.py::test_bf16_kernels_compile_without_spills[d128]",
    "tests/test_gpu_compile_kernels.py::test_large_head_dim_and_float32_fit_the_shared_memory[d64-f32]",
    "tests/test_plan.py::test_optimizer_offload_puts_the_state_in_host_memory",
    "tests/test_plan.py::test_remat_full_keeps_one_copy_of_the_saved_layer_inputs",
    "tests/test_plan.py::test_streamed_update_writes_the_layers_parameters_in_place",
    "tests/test_plan.py::test_the_unrolled_update_holds_few_layers_states_on_the_device_at_once",
    "tests/test_plan.py::test_head_groups_shrink_the_kernels_buffers",
    "tests/test_plan.py::test_remat_nested_moves_a_groups_layer_inputs_to_host_memory",
    "tests/test_plan.py::test_a_moe_plan_lists_its_grouped_matmul_kernels",
    "tests/test_plan_search.py::test_find_max_seq_len_is_the_boundary",
    "tests/test_plan_search.py::test_estimate_counts_the_reruns_in_the_compiled_program_not_the_flags",
    "tests/test_plan_search.py::test_a_one_gpu_plan_names_its_host_assumption",
    # notes of the start-up lines; the start lines themselves stay in test_fine_tuning_defaults_overlong_sft_dropped_
    # and_an_edited_folder (SFT records, the optimizer's defaults) and test_text_documents_cut_are_counted_...
    "tests/test_finetune_cli.py::test_new_user_silences_are_said_at_start",
    "tests/test_finetune_cli.py::test_sft_start_line_adds_up_with_held_out_records",
    # the whole path of an --init-from-hf run in one test; its parts stay: --init-from-hf training and an exact resume
    # through the entry point in test_moe_hf.py::test_tiny_moe_trains_on_sft_data_and_resumes_exactly, a changed
    # folder refused in test_finetune_cli.py::test_fine_tuning_defaults_overlong_sft_dropped_and_an_edited_folder,
    # eval of a run in test_cli.py::test_eval_reads_the_run_and_refuses_other_data, export through the CLI in
    # test_a_preset_run_exports and export parity per family in test_hf.py
    "tests/test_cli_hf.py::test_init_from_hf_resume_eval_export_load",
    # --optim.master-weights is compiled in test_plan.py::test_train_args_compile_the_planned_program[host optimizer]
    # and refused on resume by name in test_cli.py::test_run_dir_of_another_run_is_refused; its training and the
    # export of its float32 masters run in `make test-slow` only
    "tests/test_cli_hf.py::test_master_weights_run_exports_its_float32_masters",
    # masked labels on shards: test_loss.py::test_shards_and_rows_without_valid_tokens; SP=P == SP=1 with masked
    # labels (each document's last position) in test_model.py; the SFT masks themselves are hand-checked in this file
    "tests/test_sft.py::test_masked_loss_and_gradients_equal_across_meshes",
    # the float8 model beside the bf16 one: test_float8_model_is_close_to_the_bf16_model (loss and gradients); float8
    # through the train step, its accumulation and a resume: test_delayed_history_through_the_step_accumulation_...
    "tests/test_fp8.py::test_ten_steps_learn_as_bf16_does",
    # each kernel's sinks: test_pair_kernels_put_the_sink_in_o_and_lse and test_local_attention_with_sinks_matches_f64;
    # sinks under Ulysses in test_ulysses_with_sinks_matches_f64; the tiled sublayer's head groups (without sinks) in
    # tests/test_model.py
    "tests/test_sinks.py::test_tiled_attention_head_groups_with_sinks[xla-heads1-4-0-True]",
    "tests/test_sinks.py::test_sinks_none_is_unchanged_and_sinks_matter[blockwise]",
    "tests/test_sinks.py::test_sinks_none_is_unchanged_and_sinks_matter[pallas]",
    # a benchmark's CPU dry run (interpret-mode Pallas); its fla child, whose refused backward still gives the
    # forward's time, stays in test_bench_delta_times_fla_forward_when_its_backward_is_refused
    "tests/test_experiments.py::test_bench_delta_times_both_precisions",
    # compile-only H100 figures of one float8 feature each (16-28 s apiece on one core); the float8 GEMMs of the plain
    # model's H100 program stay in test_the_h100_program_runs_every_projection_gemm_in_float8, the float8 FSDP gathers
    # in test_fsdp_gathers_the_projection_weights_in_float8[0], LoRA's base at rest bit for bit in
    # test_lora_base_at_rest_gives_the_per_step_values, the delta-net's float8 numerics in
    # test_a_hybrids_delta_net_runs_its_projections_in_float8, the tiled attention's float8 against float32 in
    # test_the_float8_path_without_rounding_equals_float32_on_one_device[gate]
    "tests/test_fp8.py::test_lora_base_at_rest_is_neither_cast_nor_transposed_in_the_step[1]",
    "tests/test_fp8.py::test_the_h100_program_runs_the_delta_nets_projections_in_float8[False]",
    "tests/test_fp8_tiled_attention.py::test_fsdp_gathers_the_tiled_attentions_weights_in_float8",
    # the same bit for bit of the stacks quantised before the loop: test_the_stacks_quantised_before_the_loop_give_the_
    # loops_values[plain] (its hybrid and tiled programs were in `make test-slow` already)
    "tests/test_fp8_stack.py::test_the_h100_program_copies_no_stacked_weight[plain]",
    # a second end-to-end CLI run of a resume: a checkpoint of either optimizer layout restored into the other (the same
    # values, shardings and memory kinds) stays in test_step.py::test_a_checkpoint_resumes_across_the_optimizer_state_
    # layouts, the CLI's exact resume in test_moe_hf.py::test_tiny_moe_trains_on_sft_data_and_resumes_exactly
    "tests/test_cli.py::test_resume_with_the_optimizer_moved_to_host_memory",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    # an entry that names no test (a test renamed, or its parameters' ids changed) would leave its test in the default
    # suite unseen: refused where the entry's test function was collected whole (no node id on the command line)
    if not any("::" in arg for arg in config.args):
        ids = {item.nodeid for item in items}
        functions = {nodeid.split("[")[0] for nodeid in ids}
        stale = sorted(n for n in SLOW if n not in ids and n.split("[")[0] in functions)
        if stale:
            raise pytest.UsageError(f"tests/conftest.py's SLOW names tests that were not collected: {stale}; "
                                    "write their node ids as `pytest --collect-only -q` prints them")
    # aot tests compile for H100s without a GPU; they need the CUDA plugin (`make test` installs it on Linux).
    # In CI (CI set) they always run, so a missing plugin fails there instead of passing by skipping.
    skip_aot = None
    if not cuda_plugin_installed() and not os.environ.get("CI"):
        skip_aot = pytest.mark.skip(reason=f"needs the CUDA plugin: {INSTALL_HINT}")
    skip_gpu = None if jax.default_backend() == "gpu" else pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_aot is not None and "aot" in item.keywords:
            item.add_marker(skip_aot)


# Fresh random inputs on every run, reproducible on demand: each test draws from
# crc32(test id) ^ base seed, where the base seed is new each session unless
# ULYSSES_TEST_SEED is set; it is printed in the report header. The first process
# (xdist's controller) puts its draw in the environment, which the workers it starts
# inherit: one base seed a run, so the header's value reproduces every test of it.
import random  # noqa: E402
import zlib  # noqa: E402

os.environ.setdefault("ULYSSES_TEST_SEED", str(random.SystemRandom().randrange(2**31)))
BASE_SEED = int(os.environ["ULYSSES_TEST_SEED"])


def pytest_report_header(config):
    return f"ulysses_jax: random inputs with ULYSSES_TEST_SEED={BASE_SEED} (set it to reproduce)"


@pytest.fixture
def seed(request):
    return (zlib.crc32(request.node.nodeid.encode()) ^ BASE_SEED) % 2**31
