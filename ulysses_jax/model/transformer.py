"""The transformer users train: Flax NNX, parameters FSDP-sharded at rest, attention through Ulysses.

Shape names. A shaped tensor carries its dimensions as a suffix of single letters (nanodo style):
``B`` batch, ``S`` sequence, ``D`` model width (``hidden``), ``N`` query heads, ``K`` KV heads, ``H`` head
dim, ``F`` MLP width, ``V`` vocabulary; e.g. ``x_BSD``, ``q_BSNH``, ``w_DF``. Shapes are global; under
sharding each device holds ``[B / (data*fsdp), S / sp, ...]`` of an activation.

Architecture (Llama 3 / Qwen 2.5 / Qwen 3 / Mistral): token embedding, ``num_layers`` pre-norm blocks
``x + attn(norm(x))``, ``x + mlp(norm(x))`` with RMSNorm, RoPE (optionally Llama-3 scaled; half-split
rotation as in the Hugging Face checkpoints), GQA attention with optional q/k/v bias (Qwen 2.5) and
optional per-head RMSNorm of q and k before RoPE (Qwen 3), SwiGLU MLP, final RMSNorm, and an unembedding
that is the embedding table when ``tie_embeddings``. The unembedding is stored ``[V, D]`` in both cases.
Gemma 3 adds (``ModelConfig``): a norm after each sublayer too, norm scales ``1 + w``, GeGLU, embeddings times
sqrt(D), and local layers with a sliding window and their own RoPE base (``model/layer_kinds.py``: a ``lax.switch``
per scanned layer). The attention sublayer is ``model/attention.py``.

Hybrids (Qwen3.5, Qwen3-Next): "linear" layers whose token mixer is the gated delta-net (``model/delta_net.py``) among
full-attention ones (output-gated, partial RoPE). The scan stays one, over every layer, and the ``lax.switch`` on the
layer's kind runs one mixer; but each mixer's parameters (with their LoRA adapters and float8 copies) are stacked over
its own layers only (``layer_kinds.mixer_layers``: Qwen3.5-9B's attention over 8 rows, its delta-net over 24), kept out
of the scanned state (``split_block``) and read inside the scan at the layer's row (``layer_rows``: a dynamic slice of
the stack at rest, before any gather), so a model stores exactly the parameters it has (before: every layer held both
mixers, 21.8% more parameters, gradients and optimizer state for Qwen3.5-9B). A layer of the other kind reads row 0,
which its switch leaves unused (its cotangent zeros). The tools that walk the stacked block see one layer structure
as before; import and export map a row to its layer (``families.tensors.Entry.layers``). Sharding: every parameter is
created already split at rest (``parallel/sharding.py``, ``layers.py``): a jitted initializer per parameter writes each
device's shard directly, so no device ever holds a whole copy, and the random values do not depend on the mesh (JAX's
partitionable threefry). Parameters are gathered (constrained to their compute layout) where they are used; activations
are constrained to batch over ``("data", "fsdp")`` and sequence over ``("ring", "sp")``. Ulysses x ring (a mesh with
``ring > 1``): the sequence is split over ``("ring", "sp")`` and the model computes in the ring's token order (zigzag,
for causal load balance): tokens, positions and segment ids are permuted once at the input, positions first derived in
the natural order; attention masks use the true positions, and every other layer works per token, so nothing else
changes. ``hidden_states`` / ``__call__`` return the natural order (one gather at the end); the loss
(``loss.next_token_loss``) permutes the labels instead and keeps the ring order throughout (``ring_order``). Layers: one
``Block`` holds the parameters of all ``L`` layers stacked on a leading ``"layers"`` axis and the forward is a
``jax.lax.scan`` over it. Compile time does not grow with depth, and XLA holds one layer's gathered weights and
full-size gradients at a time (an unrolled loop lets it gather every layer's weights up front and combine every gradient
reduction at the end). ``scan_unroll`` unrolls it all the same (a speed tool for one GPU): the scan writes what each
layer saves for the backward into buffers stacked over the layers, which XLA fills with zeros first and copies slices
in and out of (llama3.2-1b at 32K on one compile-only H200: 30.3 GiB of zero fills and 296 slice updates a step;
unrolled 1.6 GiB and 8, for 1.7 GiB more live memory), and copies each layer's frozen weights out of their stacks
before its GEMMs read them (LoRA's base: 1,576 copies a step for llama3.1-8b at 8K with fp8, 70 unrolled); remat then
guards its recomputation against XLA's common-subexpression elimination (``prevent_cse``), which the scan makes
needless. Memory tools (``ModelConfig``):
``remat`` wraps the scanned layer in ``jax.checkpoint`` with a policy (each layer's input pinned row-major,
``row_major``, so that XLA keeps one copy of the saved inputs);
``remat_every=k`` checkpoints groups of ``k`` layers instead, keeping one input per group (``L/k + k`` saved inputs
instead of ``L``); ``mlp_chunk`` runs the MLP sublayer (norm, MLP, residual add) over sequence chunks of each device's
local sequence inside ``shard_map`` (so chunking never moves activations between devices), each chunk rematerialised;
``attn_chunk`` does the same for the attention sublayer around the whole-sequence kernel (``tiled_attention.py``: the
projections and the all-to-alls per chunk; with ``attn_head_chunk``, one group of heads at a time).

Float8 (``fp8``): the q, k, v, o, gate, up and down GEMMs run on float8 operands, forward and backward
(``model/fp8.py``); split weights are quantised where they rest and gathered in float8, unsplit ones (one GPU, data
parallelism alone) quantised for the whole stack before the layer loop, in both layouts (``fp8_stack``), LoRA's frozen
base stored in float8 (``fp8_base``). With the delayed recipe, ``Attention`` and ``MLP`` hold their projections' amax
histories (``fp8.History``), stacked like the parameters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from ulysses_jax.kernels.gated_delta import BLOCK_STATES
from ulysses_jax.model import fp8, fp8_base, fp8_stack, host_offload, lora
from ulysses_jax.model.attention import Attention
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.delta_net import DeltaNet, check_mesh
from ulysses_jax.model.layers import ParamMaker, RMSNorm, default_positions, use, wide_dot
from ulysses_jax.model.mlp import MLP, MLP_GATE, MLP_UP
from ulysses_jax.model.moe import MoE, RouterStats
from ulysses_jax.model.tiled_attention import FLOAT8, tiled_attention
from ulysses_jax.parallel.kept import ATTN_LSE, ATTN_OUT
from ulysses_jax.parallel.mesh import MESH_AXES, RING
from ulysses_jax.parallel.sharding import check_batch, check_seq, constrain, row_major
from ulysses_jax.parallel.ulysses import ring_token_order

RESIDUAL = "residual"  # checkpoint_name of each block's input: what remat="offload" sends to host memory
GROUP_INPUT = "group_input"  # with remat_every > 1: each group's input, what the policy keeps instead


class Block(nnx.Module):
    """One pre-norm transformer layer; built with ``ParamMaker(stack=L)`` it holds all ``L`` layers stacked."""

    def __init__(self, make: ParamMaker):
        self.mesh = make.mesh
        self.attn_norm = RMSNorm(make, make.cfg.hidden, ("embed",))
        self.attn = Attention(_apart(make, "attn"))
        if make.cfg.linear_layers:  # a hybrid: each token mixer stacked over its own layers (module doc)
            self.delta = DeltaNet(_apart(make, "delta"))
        self.mlp_norm = RMSNorm(make, make.cfg.hidden, ("embed",))
        if make.cfg.has_dense_mlp:
            self.mlp = MLP(_apart(make, "mlp"))
        if make.cfg.num_experts:  # mixed with dense layers: each MLP kind stacked over its own layers (module doc)
            self.moe = MoE(_apart(make, "moe"))
        if make.cfg.post_norms:  # Gemma 3: each sublayer's output normed before the residual add
            self.post_attn_norm = RMSNorm(make, make.cfg.hidden, ("embed",))
            self.post_mlp_norm = RMSNorm(make, make.cfg.hidden, ("embed",))
        if make.cfg.lora is not None:  # LoRA adapters on the projections (model/lora.py)
            lora.attach(self, make.cfg, make.mesh, make.rngs)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kind=None, sparse=None, valid_BS=None, drop=None,
                 fp8_ready=None):
        """``(x, router sums)``: the layer's output and, with experts, its ``(assigned [E], prob sums [E], tokens)``
        (``moe.py``; ``()`` without experts). ``kind``: this layer's index into ``cfg.window_kinds`` (traced under the
        layer scan): a ``lax.switch`` runs the attention sublayer of that kind; ``None`` with a single kind.
        ``sparse``: whether this layer's MLP is the experts (traced; needed when the model mixes dense and sparse
        layers); ``valid_BS``: the tokens the router statistics count; ``drop``: LoRA dropout's ``(key, token ids)``
        while training (``lora.low_rank``); ``fp8_ready``: this layer's float8 weights quantised before the layer loop
        (``fp8_stack.quantized``'s row: ``{module: {weight: fp8.Quantized}}``), or None."""
        cfg = self.attn.cfg
        ready = fp8_ready or {}
        x_BSD = checkpoint_name(x_BSD, RESIDUAL)
        branches = [functools.partial(self._attention, kind=i, drop=drop, ready=ready.get("attn"))
                    for i in range(len(cfg.window_kinds))]
        if cfg.linear_layers:  # the delta-net's branch, after the attention kinds (layer_kinds.kind_index)
            branches.append(functools.partial(self._linear, drop=drop, ready=ready.get("delta")))
        if len(branches) == 1:
            h_BSD = branches[0](x_BSD, positions_BS, segment_ids_BS)
        elif kind is None:
            raise ValueError(f"this model mixes token mixers {cfg.window_kinds} (+ linear: {bool(cfg.linear_layers)}); "
                             f"pass the layer's kind index")
        else:
            h_BSD = jax.lax.switch(kind, branches, x_BSD, positions_BS, segment_ids_BS)
        h_BSD = constrain(h_BSD, self.mesh, ("batch", "seq", "embed"))
        if not cfg.num_experts:
            return self._dense(h_BSD, drop, ready.get("mlp")), ()
        if valid_BS is None:
            valid_BS = jnp.ones(h_BSD.shape[:2], bool)

        def experts(h_BSD):
            out, sums = self.moe.residual(h_BSD, valid_BS, self.mlp_norm.scale.get_value())
            return constrain(out, self.mesh, ("batch", "seq", "embed")), sums

        if not cfg.has_dense_mlp:
            return experts(h_BSD)
        if sparse is None:
            raise ValueError(f"this model mixes dense layers {list(cfg.dense_layers)} with sparse ones; pass the "
                             f"layer's sparse flag")
        e = cfg.num_experts
        nothing = (jnp.zeros(e, jnp.float32), jnp.zeros(e, jnp.float32), jnp.zeros((), jnp.float32))
        return jax.lax.cond(sparse, experts, lambda h: (self._dense(h, drop), nothing), h_BSD)

    @jax.named_scope("mlp")  # a profile's category (experiments/profile_step.py)
    def _dense(self, h_BSD, drop=None, ready=None):
        """``h + mlp(norm(h))`` (with ``post_norms``: ``h + post_norm(mlp(norm(h)))``), tiled with ``mlp_chunk``;
        ``ready``: the MLP's float8 weights of ``fp8_stack``, or None."""
        cfg = self.attn.cfg
        if cfg.mlp_chunk:  # the norms and the residual inside the chunks too
            post = self.post_mlp_norm if cfg.post_norms else None
            return constrain(self.mlp.residual_tiled(h_BSD, self.mlp_norm, post, lora.pairs(self, "mlp", True), drop,
                                                     ready), self.mesh, ("batch", "seq", "embed"))
        y_BSD = self.mlp(self.mlp_norm(h_BSD), lora.pairs(self, "mlp"), drop, ready)
        if cfg.post_norms:
            y_BSD = self.post_mlp_norm(y_BSD)
        return constrain(h_BSD + y_BSD, self.mesh, ("batch", "seq", "embed"))

    @jax.named_scope("attention")
    def _attention(self, x_BSD, positions_BS, segment_ids_BS, *, kind: int, drop=None, ready=None):
        """``x + attention(norm(x))`` (normed again before the add with ``post_norms``) of attention kind ``kind``;
        ``ready``: q, k, v and o's float8 weights of ``fp8_stack``, or None."""
        cfg = self.attn.cfg
        if cfg.attn_chunk:  # fp8_stack's float8 weights by the tiled sublayer's names (wq, wk, wv, wo)
            ready = ready and {k: ready[attr] for k, (attr, _) in zip(FLOAT8, fp8_base.WEIGHTS["attn"])}
            return tiled_attention(x_BSD, positions_BS, segment_ids_BS, self.attention_params(), cfg=cfg,
                                   mesh=self.mesh, chunk=cfg.attn_chunk, head_chunk=cfg.attn_head_chunk,
                                   recompute=cfg.attn_recompute, kind=kind, ready=ready)
        y_BSD = self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, kind, lora.pairs(self, "attn"), drop,
                          ready)
        return x_BSD + (self.post_attn_norm(y_BSD) if cfg.post_norms else y_BSD)

    @jax.named_scope("linear_attention")
    def _linear(self, x_BSD, positions_BS, segment_ids_BS, *, drop=None, ready=None):
        """``x + delta_net(norm(x))``: a gated delta-net layer (``model/delta_net.py``; positions unused); ``ready``:
        its float8 weights of ``fp8_stack``, or None."""
        # the norm recomputed in the backward: its float32 intermediates of the device's whole sequence were kept
        # (six float32 [S/sp, hidden] buffers in Qwen3.5-9B's compiled step at 1M tokens); the delta-net applies it,
        # in each head group again
        return x_BSD + self.delta(x_BSD, segment_ids_BS, lora.pairs(self, "delta"), drop,
                                  norm=functools.partial(self.attn_norm, remat=True), ready=ready)

    def attention_params(self) -> dict:
        """This layer's attention parameters by ``tiled_attention.PARAMS`` names, at rest, in the compute dtype
        (norm scales in float32)."""
        a, dt = self.attn, self.attn.cfg.compute_jnp_dtype
        found = {"norm": self.attn_norm.scale}
        # the projection weights as arrays: LoRA's float8 base (fp8_base) dequantised
        weights = {k: fp8_base.plain(a, attr, dt) for k, (attr, _) in zip(("wq", "wk", "wv", "wo"),
                                                                           fp8_base.WEIGHTS["attn"])}
        if a.cfg.qkv_bias:
            found.update(bq=a.bq_NH, bk=a.bk_KH, bv=a.bv_KH)
        if a.cfg.qk_norm:
            found.update(q_norm=a.q_norm.scale, k_norm=a.k_norm.scale)
        if a.cfg.post_norms:
            found.update(post_norm=self.post_attn_norm.scale)
        if a.cfg.attn_sinks:
            found.update(sinks=a.sinks_N)
        if fp8.value(a) is not None:  # delayed float8 scaling: q, k, v, o's amax histories
            found[fp8.HISTORY_KEY] = a.fp8_history
        return weights | {k: p.get_value().astype(jnp.float32 if k.endswith("norm") or k in ("sinks", fp8.HISTORY_KEY)
                                                   else dt) for k, p in found.items()}


def _apart(make: ParamMaker, module: str) -> ParamMaker:
    """``make`` for ``module``'s parameters: stacked over that module's layers only where it is ``stacked_apart``."""
    if make.stack is None or module not in make.cfg.stacked_apart:
        return make
    return dataclasses.replace(make, stack=len(make.cfg.stacked_layers(module)))


def module_of(path) -> str:
    """The ``Block`` module whose stack holds the state at ``path``: its first name, or for a LoRA adapter
    (``lora.w_<target>_<a|b>``) the module of the weight it adapts."""
    head = str(path[0])
    return lora.WEIGHTS[str(path[1])[2:-2]][0] if head == "lora" else head


def _held_by(module: str, path, _value) -> bool:
    """An ``nnx`` filter: the ``Block`` state in ``module``'s stack (``module_of``)."""
    return module_of(path) == module


def split_block(block, cfg):
    """``(graphdef, state stacked over every layer, [(state of a module stacked apart, its row per layer [L] int32),
    ...])`` of the stacked ``block``: each of ``cfg.stacked_apart`` (a hybrid's token mixers, the two MLP kinds of a
    model mixing dense and sparse layers) apart, stacked over its own layers."""
    apart = cfg.stacked_apart
    graphdef, *parts = nnx.split(block, *(functools.partial(_held_by, m) for m in apart), ...)
    rows = [jnp.asarray(cfg.stack_rows(m), jnp.int32) for m in apart]
    return graphdef, parts[-1], list(zip(parts[:-1], rows))


def layer_rows(own, index) -> list:
    """Each module's state of ``split_block`` at the row layer ``index`` (traced, in the layer scan) reads."""
    return [jax.tree.map(lambda a, r=rows[index]: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), state)
            for state, rows in own]


# ----------------------------------------------------------------------------------------------
# Remat policies


def remat_policy(name: str, mesh: Mesh, offloaded: str = RESIDUAL, keep_attention: bool = False,
                 keep_mlp: bool = False):
    """The ``jax.checkpoint`` policy of ``ModelConfig.remat`` (``None`` = save nothing but block inputs).
    ``keep_attention`` (``ModelConfig.attn_keep``): attention's output and log-sum-exp (``parallel/kept.py``'s names)
    are saved too, and a delta-net's output with its rule's block states (``gated_delta.BLOCK_STATES``), so that
    neither token mixer's forward runs again in the backward: on the device, or offloaded to pinned host memory with
    ``offload``. ``keep_mlp`` (``ModelConfig.mlp_keep``, with ``full``): the MLP's gate and up products too
    (``mlp.MLP_GATE``, ``mlp.MLP_UP``), so that the backward runs none of the MLP's GEMMs again."""
    kept = ([ATTN_OUT, ATTN_LSE, BLOCK_STATES] if keep_attention else []) + ([MLP_GATE, MLP_UP] if keep_mlp else [])
    if name == "full":
        return jax.checkpoint_policies.save_only_these_names(*kept) if kept else None
    if name == "save_matmuls":  # keep projection / MLP matmul outputs, recompute attention and elementwise
        dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return jax.checkpoint_policies.save_from_both_policies(
            dots, jax.checkpoint_policies.save_only_these_names(*kept)) if kept else dots
    if name == "offload":
        # GPUs have pinned host memory; compile-only GPU devices (``ulysses_jax.plan.targets``) list no memories at
        # all, yet XLA compiles the offload for them, so the check asks the target's platform first.
        kinds = {m.kind for d in mesh.devices.flat for m in d.addressable_memories()}
        if mesh.devices.flat[0].platform != "gpu" and "pinned_host" not in kinds:
            raise ValueError(
                f"remat='offload' needs the 'pinned_host' memory kind, but the {mesh.devices.flat[0].platform} "
                f"devices of this mesh offer only {sorted(kinds)}; use remat='full' on this backend"
            )
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[offloaded, *kept],
            offload_src="device", offload_dst="pinned_host",
        )
    raise ValueError(f"no checkpoint policy for remat={name!r}")


# ----------------------------------------------------------------------------------------------
# The model


class Transformer(nnx.Module):
    """``Transformer(config, mesh=mesh, rngs=nnx.Rngs(seed))``; ``model(tokens)`` -> float32 logits ``[B, S, V]``.

    ``hidden_states`` returns the final-normed hidden states ``[B, S, D]`` (what the tiled loss consumes);
    ``logits`` maps them through the unembedding.
    """

    def __init__(self, config: ModelConfig, *, mesh: Mesh, rngs: nnx.Rngs):
        if tuple(mesh.axis_names) != MESH_AXES:
            raise ValueError(f"the mesh must have axes {MESH_AXES} (use make_mesh), got {mesh.axis_names}")
        self.config, self.mesh = config, mesh
        cfg = config
        if cfg.linear_layers:
            check_mesh(cfg, mesh)
        make = ParamMaker(cfg, mesh, rngs)
        with nnx.use_eager_sharding(False):  # values are already laid out by ParamMaker
            self.embed_VD = make("embed", (cfg.vocab_size, cfg.hidden), ("vocab", "embed"))
            self.blocks = Block(dataclasses.replace(make, stack=cfg.num_layers))
            if fp8_base.applies(cfg):  # LoRA + --fp8: the frozen projections in float8 where they rest
                fp8_base.freeze(self.blocks, cfg, mesh)
            self.final_norm = RMSNorm(make, cfg.hidden, ("embed",))
            if not cfg.tie_embeddings:
                self.lm_head_VD = make("lm_head", (cfg.vocab_size, cfg.hidden), ("vocab", "embed"))

    @property
    def unembedding(self) -> nnx.Param:
        """The ``[V, D]`` output projection: the embedding table when tied."""
        return self.embed_VD if self.config.tie_embeddings else self.lm_head_VD

    def ring_permutation(self, seq_len: int) -> np.ndarray | None:
        """The token order the model computes in (``x[:, perm]``): ``None`` (natural) without a ring."""
        return ring_token_order(seq_len, self.mesh.shape[RING])

    def ring_order(self, batch: dict) -> dict | None:
        """``batch`` (``[B, S]`` arrays in the natural order: ``tokens``, and any of ``labels``, ``segment_ids``,
        ``positions``) permuted into the ring's token order, ``positions`` filled in first; ``None`` without a ring.
        Labels must be shifted already (``labels[t]`` is the token after ``tokens[t]``)."""
        perm = self.ring_permutation(batch["tokens"].shape[1])
        if perm is None:
            return None
        batch = dict(batch)
        if batch.get("positions") is None:
            batch["positions"] = default_positions(batch["tokens"], batch.get("segment_ids"))
        return {k: x if x is None else x[:, perm] for k, x in batch.items()}

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, *, permuted: bool = False) -> jax.Array:
        """Final-normed hidden states ``[B, S, D]`` of int ``tokens [B, S]``; ``positions`` default to 0, 1, ...
        restarting at each document of ``segment_ids`` (packed rows; equal ids attend to each other).

        ``permuted=True`` (meaningful with a ring): the inputs are already in the ring's token order
        (``ring_order``; give ``positions``) and the output stays in it."""
        return self.hidden_and_router(tokens, positions, segment_ids, permuted=permuted)[0]

    def hidden_and_router(self, tokens: jax.Array, positions: jax.Array | None = None,
                          segment_ids: jax.Array | None = None, *, permuted: bool = False,
                          dropout_key: jax.Array | None = None):
        """``(hidden_states(...), RouterStats)`` of the sparse layers (``None`` without experts); the router counts
        the tokens whose segment id is not 0 (0 is padding in the data pipeline), every token without segment ids.
        ``dropout_key``: a training step's key for LoRA's dropout (``LoraConfig.dropout``); ``None``: no dropout."""
        cfg, mesh = self.config, self.mesh
        tokens_BS, positions_BS, segment_ids_BS = tokens, positions, segment_ids
        if tokens_BS.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, seq], got {tuple(tokens_BS.shape)}")
        check_batch(tokens_BS.shape[0], mesh)
        check_seq(tokens_BS.shape[1], mesh)
        for name, arr in (("positions", positions_BS), ("segment_ids", segment_ids_BS)):
            if arr is not None and tuple(arr.shape) != tuple(tokens_BS.shape):
                raise ValueError(f"{name} shape {tuple(arr.shape)} must equal the tokens' {tuple(tokens_BS.shape)}")
        perm = self.ring_permutation(tokens_BS.shape[1])
        if perm is not None and permuted and positions_BS is None:
            raise ValueError("with permuted=True give the positions (permuted like the tokens: Transformer.ring_order)")
        if perm is not None and not permuted:  # into the ring's order here, back at the end
            ordered = self.ring_order(dict(tokens=tokens_BS, positions=positions_BS, segment_ids=segment_ids_BS))
            tokens_BS, positions_BS, segment_ids_BS = ordered["tokens"], ordered["positions"], ordered["segment_ids"]
        tokens_BS = constrain(tokens_BS, mesh, ("batch", "seq"))
        if segment_ids_BS is not None:
            segment_ids_BS = constrain(segment_ids_BS, mesh, ("batch", "seq"))
        if positions_BS is None:
            positions_BS = default_positions(tokens_BS, segment_ids_BS)
        positions_BS = constrain(positions_BS, mesh, ("batch", "seq"))
        x_BSD = jnp.take(use(self.embed_VD, mesh, cfg.compute_jnp_dtype), tokens_BS, axis=0)
        if cfg.scale_embeddings:  # Gemma: times sqrt(hidden), the factor rounded to the compute dtype first
            x_BSD = x_BSD * jnp.asarray(cfg.hidden**0.5, cfg.compute_jnp_dtype)
        x_BSD = constrain(x_BSD, mesh, ("batch", "seq", "embed"))
        graphdef, blocks, own = split_block(self.blocks, cfg)  # stacked apart: read by row, not scanned
        # each layer's attention kind (model/layer_kinds.py) and MLP kind travel through the scan with its parameters
        sparse_L = np.isin(np.arange(cfg.num_layers), cfg.sparse_layers)
        # --fp8 on unsplit weights: the projection stacks quantised here, once, in both layouts (fp8_stack)
        ready, ready_apart = fp8_stack.quantized(blocks, own, cfg, mesh)
        stacked = (blocks, jnp.asarray(cfg.kind_of_layer, jnp.int32), jnp.asarray(sparse_L),
                   jnp.arange(cfg.num_layers, dtype=jnp.int32), ready)
        valid_BS = None if segment_ids_BS is None else segment_ids_BS != 0
        ids_BS = None
        if dropout_key is not None and cfg.lora is not None and cfg.lora.dropout:  # each token's mask: its index
            ids_BS = lora.token_ids(tokens_BS.shape)
            ids_BS = constrain(ids_BS if perm is None else ids_BS[:, perm], mesh, ("batch", "seq"))

        def layer(x_BSD, layer_state, positions_BS, segment_ids_BS):
            layer_state, kind, sparse, index, fp8_ready = layer_state
            drop = None if ids_BS is None else (jax.random.fold_in(dropout_key, index), ids_BS)
            if cfg.remat != "none":
                x_BSD = row_major(x_BSD, mesh)
            if cfg.offload_params:  # this layer's parameters in from host memory, their gradient back out (refused
                layer_state = host_offload.stream_in(layer_state)  # with modules stacked apart: ModelConfig)
            # with the tiled attention, its LoRA targets merged
            block = lora.merged(nnx.merge(graphdef, layer_state, *layer_rows(own, index)))
            for part in layer_rows(ready_apart, index):  # a module's float8 stacks over its own layers: its row
                fp8_ready = {**fp8_ready, **part}
            return block(x_BSD, positions_BS, segment_ids_BS, kind, sparse, valid_BS, drop, fp8_ready)

        every = cfg.remat_every if cfg.remat != "none" else 1
        unroll = cfg.scan_unroll  # unrolled, no loop keeps remat's recomputation apart from the forward: prevent_cse
        if cfg.remat != "none":
            # inside a group (every > 1) the layers' inputs stay on the device for the group's backward, or with
            # remat_nested go to pinned host memory as with every == 1 (the group's input is offloaded anyway)
            inner = remat_policy(cfg.remat, mesh, keep_attention=cfg.attn_keep, keep_mlp=cfg.mlp_keep) if (
                every == 1 or cfg.remat_nested) else (
                remat_policy("full", mesh, keep_attention=True) if cfg.attn_keep else None)
            layer = jax.checkpoint(layer, policy=inner, prevent_cse=unroll)

        def layers(x_BSD, st):  # the layers of ``st``, stacked on its leading axis, one after the other
            return jax.lax.scan(lambda x, s: layer(x, s, positions_BS, segment_ids_BS), x_BSD, st, unroll=unroll)

        if every > 1:
            # groups of ``every`` layers: the policy keeps (or offloads) each group's input only; a group's
            # backward re-runs its layers' forward, holding their inputs on the device for that group alone
            group = jax.checkpoint(lambda x, st: layers(checkpoint_name(x, GROUP_INPUT), st),
                                   policy=remat_policy(cfg.remat, mesh, GROUP_INPUT, cfg.attn_keep), prevent_cse=unroll)
            grouped = jax.tree.map(lambda a: a.reshape(a.shape[0] // every, every, *a.shape[1:]), stacked)
            x_BSD, sums = jax.lax.scan(group, x_BSD, grouped, unroll=unroll)
            sums = jax.tree.map(lambda a: a.reshape(a.shape[0] * every, *a.shape[2:]), sums)
        else:
            x_BSD, sums = layers(x_BSD, stacked)
        h_BSD = self.final_norm(x_BSD)
        if perm is not None and not permuted:
            h_BSD = constrain(h_BSD[:, np.argsort(perm)], mesh, ("batch", "seq", "embed"))
        if not cfg.num_experts:
            return h_BSD, None
        rows = np.asarray(cfg.sparse_layers)  # the dense layers' rows are zeros: left out, as transformers does
        return h_BSD, RouterStats(sums[0][rows], sums[1][rows], sums[2][rows[0]])

    def logits(self, h_BSD: jax.Array) -> jax.Array:
        w_VD = use(self.unembedding, self.mesh, self.config.compute_jnp_dtype)
        logits_BSV = wide_dot("bsd,vd->bsv", h_BSD, w_VD)
        return constrain(logits_BSV, self.mesh, ("batch", "seq", "vocab"))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """float32 logits ``[B, S, V]``: ``model(tokens, positions=None, segment_ids=None)`` (see ``hidden_states``)."""
        return self.logits(self.hidden_states(tokens, positions, segment_ids))
