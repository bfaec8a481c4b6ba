"""The training job's setup (settings: ``config.py``; the step: ``step.py``; the loop: ``run_loop.py``; eval:
``evaluate.py``).

``train(TrainConfig(...))`` is what ``ulysses-jax train`` runs (the CLI flags are generated from the dataclass).
Everything the user can get wrong is checked in ``setup_train`` before anything is written, with a ``ValueError`` that
names the flag and the fix; the run record (``run.json``, see ``runconfig.py``) is written once the step has compiled.

The loop stops cleanly on SIGTERM or SIGINT (what SLURM and Ctrl-C send): it finishes the step under way, writes a
checkpoint and returns with ``stopped_by`` set; a second signal stops at once. A non-finite loss stops without saving.
A run killed outright continues with ``--resume`` from its last complete checkpoint (``checkpoint.py``), or, killed
before its first one was complete, starts again from step 0 with the settings of its record.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import uuid

import jax

from ulysses_jax.data import lengths
from ulysses_jax.data.documents import describe_sources, validate_sources
from ulysses_jax.data.pipeline import BatchIterator, check_eval_documents, process_rows
from ulysses_jax.data.tokenizers import describe_tokenizer
from ulysses_jax.interop.hf import from_hf
from ulysses_jax.model import flops, lora
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.hf_config import HF_CONFIG_FIELDS
from ulysses_jax.train import cluster, resume, runconfig
from ulysses_jax.train.checkpoint import Checkpointer
from ulysses_jax.train.config import (
    PRESET_AND_HF,
    TrainConfig,
    auto_changes,
    data_config,
    default_run_dir,
    lora_settings,
    model_config,
)
from ulysses_jax.train.devices import (  # noqa: F401 (MeshConfig and device_total_bytes re-exported)
    MeshConfig,
    build_mesh,
    check_parallel,
    device_total_bytes,
    documents_limit,
    memory_pool,
    resolve_batch,
    sequence_multiple,
)
from ulysses_jax.train.divergence import TrainingDiverged  # noqa: F401 (re-exported: cli.py, tests)
from ulysses_jax.train.metrics import check_wandb
from ulysses_jax.train.program import optimizer_of, step_program
from ulysses_jax.train.run_loop import Run, train_run  # noqa: F401 (train_run re-exported: cli.py, tests)
from ulysses_jax.train.step import (
    abstract_state,
    check_offload_params,
    check_warmup,
    init_state,
    make_eval_step,
    state_shardings,
)


def _peak(cfg_peak_tflops: float | None) -> float | None:
    if cfg_peak_tflops is not None:
        if cfg_peak_tflops <= 0:
            raise ValueError(f"--peak-tflops ({cfg_peak_tflops}) must be positive")
        return cfg_peak_tflops * 1e12
    return flops.peak_flops(jax.devices()[0].device_kind)


def _profile_range(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {spec!r} must look like A:B (two step numbers, A < B)") from None
    if not 0 <= a < b:
        raise ValueError(f"--profile-steps {spec!r} must look like A:B with 0 <= A < B")
    return a, b


def _hf_weights(folder: str | None, model: ModelConfig, mesh, seed: int = 0):
    """The ``--init-from-hf`` model with its weights, each parameter read into its sharding on ``mesh`` (or None); with
    ``--lora-rank``, fresh adapters on it (``lora.adapted``)."""
    if folder is None:
        return None
    training = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
                if f.name not in HF_CONFIG_FIELDS and f.name != "lora"}
    base = from_hf(folder, mesh=mesh, **training)
    if model.lora is None:
        return base
    from flax import nnx

    from ulysses_jax.model.transformer import Transformer

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(model, mesh=mesh, rngs=nnx.Rngs(seed))))
    return lora.adapted(base, graphdef, model, seed)


def _continuation(cfg: TrainConfig, recorded: dict, where: runconfig.RunDir, notes: list[str]):
    """Where a resumed run starts and its schedule: ``(start step, optim as first planned, decay end now, replans)``.

    The recorded schedule is kept; ``--optim.decay-steps`` other than the recorded end re-plans the decay from the
    step the run continues from (``step.make_schedule``), so the learning rate never jumps.
    """
    start = cfg.resume_from if cfg.resume_from is not None else where.steps[-1]
    if start not in where.steps:
        raise ValueError(f"--resume-from {start}: no such checkpoint in {where.checkpoints} (steps: "
                         f"{', '.join(map(str, where.steps))})")
    if start >= cfg.steps:
        raise ValueError(f"--resume: the run is at step {start} of --steps {cfg.steps}; raise --steps to continue")
    sched = recorded.get("schedule", {})
    replans = [list(r) for r in sched.get("replans", [])]
    first = sched.get("decay_steps", cfg.optim.resolved(cfg.steps).decay_steps)
    horizon = replans[-1][1] if replans else first
    asked = cfg.optim.decay_steps
    if asked is not None and asked != horizon:
        if asked <= start:
            raise ValueError(f"--optim.decay-steps ({asked}) must be after the step the run continues from ({start})")
        replans.append([start, asked])
        horizon = asked
        notes.append(f"learning rate: decaying anew from step {start} to its minimum at step {asked}")
    elif cfg.steps > horizon:
        notes.append(f"learning rate: the run's schedule ends at step {horizon}; steps after it keep the minimum "
                     f"rate (--optim.decay-steps N decays anew to step N)")
    warmup = cfg.optim.warmup_steps if cfg.optim.warmup_steps is not None else sched.get("warmup_steps")
    return start, dataclasses.replace(cfg.optim, decay_steps=first, warmup_steps=warmup), horizon, replans


def setup_train(cfg: TrainConfig, loop_eval_setup=None, memory_setup=None) -> Run:
    """Validate everything and build (or restore) the state; raises ValueError on user error; writes the record last.

    ``loop_eval_setup``: how the in-training evaluations of ``--eval-by-position`` / ``--eval-passkey`` are built
    (``ulysses_jax.evaluation.loop.LoopEval.setup``; the evaluation layer sits above this one, so it is handed in:
    ``ulysses-jax train`` and ``ulysses_jax.evaluation.loop.train`` do). ``memory_setup(cfg, mesh=, batch_size=)``:
    ``(cfg with the memory tools to train with, why)``, once the model, mesh and batch are checked, for a new run
    (``--memory auto``: ``ulysses_jax.plan.train_memory.choose_memory``, handed in by ``ulysses-jax train``)."""
    if cfg.eval_every and (cfg.eval_by_position or cfg.eval_passkey) and loop_eval_setup is None:
        raise ValueError("--eval-by-position and --eval-passkey run in the evaluation layer: start the run with "
                         "`ulysses-jax train` or ulysses_jax.evaluation.loop.train(cfg), not ulysses_jax.train.trainer")
    for name, value, least in (("--steps", cfg.steps, 1), ("--checkpoint-every", cfg.checkpoint_every, 1),
                               ("--grad-accum", cfg.grad_accum, 1), ("--seq-len", cfg.seq_len, 2),
                               ("--keep-checkpoints", cfg.keep_checkpoints, 1), ("--eval-every", cfg.eval_every, 0),
                               ("--eval-batches", cfg.eval_batches, 1 if cfg.eval_every else 0)):
        if value < least:
            raise ValueError(f"{name} ({value}) must be at least {least}")
    resuming = cfg.resume or cfg.resume_from is not None
    if cfg.init_from_hf is not None:  # the model, and unless --tokenizer is given the tokenizer, come from the folder
        if cfg.preset not in (None, "tiny"):
            raise ValueError(PRESET_AND_HF)
        if cfg.sliding_window is not None:  # (before: a 4,000-character mismatch of the two model configs)
            raise ValueError(f"--sliding-window ({cfg.sliding_window}) cannot change a model that --init-from-hf "
                             f"imports: its local layers come from the folder's config.json; drop the flag")
        folder = pathlib.Path(cfg.init_from_hf).expanduser().resolve()
        if not folder.is_dir() and not resuming:
            raise ValueError(f"--init-from-hf {cfg.init_from_hf} is not a folder; pass a Hugging Face model folder "
                             f"(config.json, *.safetensors, tokenizer.json)")
        if folder.is_dir() and not (folder / "config.json").is_file() and not resuming:
            raise ValueError(f"--init-from-hf {cfg.init_from_hf} has no config.json; pass a Hugging Face model folder "
                             f"(config.json, *.safetensors, tokenizer.json)")
        if cfg.tokenizer is None and not (folder / "tokenizer.json").is_file():
            raise ValueError(f"--init-from-hf {cfg.init_from_hf} has no tokenizer.json; pass the model's tokenizer "
                             f"with --tokenizer")
        cfg = dataclasses.replace(cfg, preset=None, init_from_hf=str(folder),
                                  tokenizer=str(folder) if cfg.tokenizer is None else cfg.tokenizer)
    if cfg.run_dir is None:
        if resuming:
            raise ValueError("--resume needs --run-dir: the directory of the run to continue")
        if jax.process_count() > 1:
            raise ValueError("a multi-process run needs --run-dir (every process must write to the same directory)")
        name = cfg.preset or pathlib.Path(cfg.init_from_hf or "tiny").name
        cfg = dataclasses.replace(cfg, run_dir=default_run_dir(name))
    check_wandb(cfg.wandb_project)
    where = runconfig.inspect(cfg.run_dir)
    if not resuming and where.steps:
        raise ValueError(f"--run-dir {cfg.run_dir} already holds checkpoints; pass --resume to continue that run "
                         f"or choose a new --run-dir (nothing was overwritten)")
    if resuming and not where.steps:
        if cfg.resume_from is not None or not where.record:
            raise ValueError(f"--resume: no checkpoint in {where.checkpoints}; start without --resume, or point "
                             f"--run-dir at a run")
        resuming = False  # the run stopped before its first checkpoint was complete: it starts again (noted below)
    recorded = runconfig.read_record(cfg.run_dir) if resuming or where.record else None

    data_cfg = data_config(cfg)
    try:
        summary = validate_sources(data_cfg, need_eval=cfg.eval_every > 0)
    except ValueError as e:  # the tokenizer read from the --init-from-hf folder is named as that folder's
        if cfg.init_from_hf is None or cfg.tokenizer != cfg.init_from_hf or not str(e).startswith("--tokenizer "):
            raise
        raise ValueError(f"the tokenizer of --init-from-hf{str(e).removeprefix('--tokenizer')} (or pass another with "
                         f"--tokenizer)") from None
    # refuses an SFT record longer than a row, advising a length that keeps the mesh
    lengths_found = lengths.measure(data_cfg, cfg.seq_len, sequence_multiple(cfg.mesh))
    sources, tokenizer = describe_sources(data_cfg), describe_tokenizer(cfg.tokenizer)
    hf_folder = None if cfg.init_from_hf is None else resume.describe_hf_folder(cfg.init_from_hf,
                                                                                  missing_ok=resuming)
    model = model_config(cfg, summary.vocab_size, record=recorded if resuming else None)
    early_notes = []
    if summary.replaced:
        early_notes.append(
            f"data: {summary.replaced} byte sequence(s) in {summary.replaced_files} file(s) are not UTF-8 and are read "
            f"as U+FFFD (the replacement character); re-encode those files as UTF-8 to keep their characters")
    if cfg.seq_len > model.max_seq_len:
        origin = "the folder's config.json" if cfg.init_from_hf else f"the {model.name} preset"
        early_notes.append(
            f"--seq-len {cfg.seq_len} is past max_position_embeddings {model.max_seq_len} of {origin}: the model meets "
            f"positions it was never trained on (RoPE as configured, no scaling added); export writes "
            f"max_position_embeddings {cfg.seq_len}, the length this run trains at")
    if resuming and (recorded or {}).get("init_from_hf"):  # a changed folder is refused below
        hf_folder = hf_folder or recorded["init_from_hf"]  # the folder is gone: the checkpoint has the weights
    mesh = build_mesh(cfg.mesh, model, cfg.seq_len)
    batch_size = resolve_batch(cfg.batch_size, mesh, cfg.grad_accum)
    check_parallel(model, mesh, seq_len=cfg.seq_len, batch_size=batch_size, grad_accum=cfg.grad_accum)
    check_offload_params(model.offload_params, cfg.optim, cfg.grad_accum)
    memory_chosen = {}  # the memory tools memory_setup chose: recorded with why, as the defaults' choices are
    if memory_setup is not None and not resuming:  # a resumed run keeps the tools it recorded
        picked, why = memory_setup(cfg, mesh=mesh, batch_size=batch_size)
        if memory_chosen := {k: {"value": v, "why": why} for k, v in auto_changes(cfg, picked).items()}:
            cfg, model = picked, model_config(picked, summary.vocab_size)
            check_parallel(model, mesh, seq_len=cfg.seq_len, batch_size=batch_size, grad_accum=cfg.grad_accum)
            check_offload_params(model.offload_params, cfg.optim, cfg.grad_accum)
    peak, profile = _peak(cfg.peak_tflops), _profile_range(cfg.profile_steps)

    notes: list[str] = early_notes
    if resuming:  # the run's settings are its record's: what its defaults chose stays recorded as chosen
        start, optim, horizon, replans = _continuation(cfg, recorded, where, notes)
        chosen = recorded.get("defaults", {})
    else:
        fine_tuning, adapters = cfg.init_from_hf is not None, model.lora is not None
        start, optim, replans = 0, cfg.optim.resolved(cfg.steps, fine_tuning=fine_tuning, lora=adapters), []
        horizon = optim.decay_steps
        check_warmup(cfg.optim, horizon)
        chosen = {f"optim.{k}": {"value": v, "why": why} for k, (v, why) in
                  cfg.optim.defaults(cfg.steps, fine_tuning, adapters).items()} | memory_chosen
        if adapters:  # the LoRA settings not given, recorded as resolved (a resume compares them)
            lora_chosen = {k: v for k, v in lora_settings(cfg, model).items() if k != "param_dtype"}
            chosen.update({k: {"value": v, "why": why} for k, (v, why) in lora_chosen.items()})
            cfg = dataclasses.replace(cfg, **{k: v for k, (v, _) in lora_chosen.items()})
    record = runconfig.make_record(cfg, model, mesh, batch_size, optim, horizon, replans, sources, tokenizer)
    fraction, source = memory_pool(cfg.memory_fraction, os.environ)  # the CLI applied it before JAX started
    record["memory_pool"] = {"fraction": fraction, "source": source}
    # a setting given on resume is no longer the default it was
    record["init_from_hf"], record["defaults"] = hf_folder, {
        k: v for k, v in chosen.items() if runconfig.get(record["config"], k) == v["value"]}
    if recorded is not None:
        why = resume.same_run(recorded, record)
        if why and resuming:
            fix = "" if why.endswith("--run-dir") else "; resume without that flag, or start a new --run-dir"
            raise ValueError(f"cannot continue {cfg.run_dir} with other settings: {why}{fix}")
        if why:
            why = why.removesuffix(", or start a new --run-dir")  # the fix of a value no flag gave: said once below
            raise ValueError(f"--run-dir {cfg.run_dir} holds another run that saved no checkpoint ({why}); choose a "
                             f"new --run-dir, or delete that directory to start over")
    if not resuming:
        if where.metrics and recorded is None:
            raise ValueError(f"--run-dir {cfg.run_dir} holds metrics of a run without run.json; choose a new "
                             f"--run-dir (nothing was overwritten)")
        if recorded is not None:
            notes.append(f"{cfg.run_dir} holds this run, which saved no checkpoint: starting it again from step 0 "
                         f"(its earlier metrics are dropped)")

    it = BatchIterator(data_cfg, seq_len=cfg.seq_len, global_batch=batch_size, seed=cfg.seed,
                       row_ids=process_rows(mesh, batch_size, cfg.seq_len))
    tx = optimizer_of(optim, cfg.steps, replans)
    if resuming:
        graphdef, target = abstract_state(model, mesh, tx, cfg.seed)
        reader = Checkpointer(cfg.run_dir, create=False)
        try:
            state, data_state = reader.restore(start, target)
        finally:
            reader.close()
        it.set_state(data_state)
    else:
        graphdef, state = init_state(model, mesh, tx, cfg.seed, model=_hf_weights(cfg.init_from_hf, model, mesh,
                                                                                       cfg.seed))
    # Compiled ahead of the loop: the program `ulysses-jax plan` compiles (train/program.py), so its memory figure is
    # the plan's.
    step_fn, batch = step_program(graphdef, state, tx, optim, steps=cfg.steps, replans=replans, mesh=mesh,
                                  batch_size=batch_size, seq_len=cfg.seq_len, grad_accum=cfg.grad_accum)
    step_fn = step_fn.lower(state, batch).compile()
    planned = device_total_bytes(step_fn.memory_analysis())
    eval_step = make_eval_step(graphdef, mesh, state_shardings(state["params"])) if cfg.eval_every else None
    if eval_step is not None and (limit := documents_limit(model, mesh, cfg.seq_len)):  # refused now, not mid-run
        cluster.decide_together(check_eval_documents, data_cfg, cfg.seq_len, batch_size, cfg.eval_batches, limit,
                                "evaluation during training")  # each process reads its rows: refused by all alike
    loop_eval = None if loop_eval_setup is None else loop_eval_setup(
        cfg, graphdef=graphdef, mesh=mesh, param_shardings=state_shardings(state["params"]), data_cfg=data_cfg,
        batch_size=batch_size, doc_limit=documents_limit(model, mesh, cfg.seq_len))

    # Everything is checked: write, the record first (a run killed from here on is one that `--resume` continues).
    starts = (recorded or {}).get("starts", []) if resuming else []
    record["starts"] = starts + [{"step": start, "time": runconfig.now(), "mesh": dict(mesh.shape),
                                  "processes": jax.process_count(), "device": jax.devices()[0].device_kind}]
    record["wandb_id"] = ((recorded or {}).get("wandb_id") if resuming else None) or uuid.uuid4().hex[:12]
    if jax.process_index() == 0:
        runconfig.write_record(cfg.run_dir, record, runconfig.to_dict(TrainConfig(), skip=runconfig.PER_INVOCATION))
    checkpointer = Checkpointer(cfg.run_dir, keep=cfg.keep_checkpoints)
    if resuming and checkpointer.set_aside(after=start) is not None:
        notes.append(f"checkpoints after step {start} moved to {where.path / 'checkpoints-set-aside'}")
    return Run(cfg, model, mesh, it, checkpointer, start, state, step_fn, peak, profile, planned, batch_size, record,
               lengths.start_line(summary, lengths_found), notes, eval_step, data_cfg, loop_eval)


def train(cfg: TrainConfig, loop_eval_setup=None) -> dict:
    """Run the training job; returns a summary (first/last loss, tokens/s, paths, ``stopped_by``). In-training
    evaluations need ``loop_eval_setup`` (``setup_train``): ``ulysses_jax.evaluation.loop.train`` passes it."""
    return train_run(setup_train(cfg, loop_eval_setup))
