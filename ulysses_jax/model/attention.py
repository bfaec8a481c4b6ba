"""The attention sublayer of a layer: GQA projections, q/k norms, RoPE (whole or partial), Ulysses attention, the
output gate and the output projection.

Llama / Qwen / Mistral / Gemma 3 / gpt-oss attention, with the per-layer switches of ``ModelConfig``: q/k/v biases,
per-head RMSNorm of q and k before RoPE, a sliding window and its own RoPE base for local layers, attention sinks, an
output-projection bias, and Qwen3.5 / Qwen3-Next's output gate (``attn_output_gate``: ``q_proj`` yields per head ``[q |
gate]``, the attention's output is multiplied by ``sigmoid(gate)`` before ``o_proj``) and partial RoPE
(``partial_rotary_factor``: the first ``rotary_dim`` dims of each head rotated, the rest untouched). With ``fp8`` the
four projections run on float8 operands (``model/fp8.py``; their amax histories here with the delayed recipe). The
exchange and the kernels are ``parallel/ulysses.py``'s; the shape letters are ``model/transformer.py``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ulysses_jax.model import fp8, fp8_base, lora
from ulysses_jax.model.layers import ParamMaker, RMSNorm, apply_rope, rope_factor, rope_frequencies, use, use_parts
from ulysses_jax.parallel.mesh import RING, SP
from ulysses_jax.parallel.sharding import constrain
from ulysses_jax.parallel.ulysses import ulysses_attention


class Attention(nnx.Module):
    def __init__(self, make: ParamMaker):
        cfg = self.cfg = make.cfg
        self.mesh = make.mesh
        d, n, k, h = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # with the output gate, each head's q projection is followed by its gate's: [q (h) | gate (h)], as stored in
        # the Hugging Face q_proj of Qwen3.5 / Qwen3-Next
        self.wq_DNH = make("attn.wq", (d, n, 2 * h if cfg.attn_output_gate else h), ("embed", "heads", "head_dim"))
        self.wk_DKH = make("attn.wk", (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = make("attn.wv", (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wo_NHD = make("attn.wo", (n, h, d), ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.bq_NH = make("attn.bq", (n, h), ("heads", "head_dim"), init="zeros")
            self.bk_KH = make("attn.bk", (k, h), ("kv_heads", "head_dim"), init="zeros")
            self.bv_KH = make("attn.bv", (k, h), ("kv_heads", "head_dim"), init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(make, h, ("head_dim",))
            self.k_norm = RMSNorm(make, h, ("head_dim",))
        if cfg.o_bias:
            self.bo_D = make("attn.bo", (d,), ("embed",), init="zeros")
        if cfg.attn_sinks:  # gpt-oss: a sink logit per head (zeros: exp(0) joins each row's softmax denominator)
            self.sinks_N = make("attn.sinks", (n,), ("heads",), init="zeros")
        if (history := fp8.make_history(cfg, make.mesh, 4, make.stack)) is not None:  # q, k, v, o (delayed float8)
            self.fp8_history = history

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kind: int = 0, adapters=None, drop=None, ready=None):
        """``kind``: static index into ``cfg.window_kinds`` (the window, and the local RoPE base for a local one).
        ``adapters``: LoRA's ``{target: (A, B)}`` (``lora.pairs``), ``drop`` its dropout's ``(key, token ids)``.
        ``ready``: this layer's float8 weights quantised before the layer loop (``fp8_stack``), or None."""
        cfg, mesh, dt = self.cfg, self.mesh, self.cfg.compute_jnp_dtype
        window = cfg.window_kinds[kind]
        adapted = functools.partial(lora.low_rank, adapters=adapters, lora=cfg.lora, drop=drop)  # LoRA's terms, or 0
        hist = fp8.value(self)  # delayed float8 scaling: the amax histories of q, k, v, o

        def proj(spec, x, attr, i):  # x @ w, in float8 with --fp8 (the weight quantised at rest, gathered in float8)
            if fp8_base.frozen(self, attr):  # LoRA's base, float8 at rest
                return fp8.einsum(spec, x, fp8_base.gathered(self, attr, mesh, dt), on=True, history=fp8.row(hist, i))
            w, gather = use_parts(getattr(self, attr), mesh, dt)
            return fp8.einsum(spec, x, fp8.carried(w, ready, attr), on=cfg.fp8, history=fp8.row(hist, i),
                              gather=gather)

        q_BSNH = proj("bsd,dnh->bsnh", x_BSD, "wq_DNH", 0) + adapted(x_BSD, target="q")
        k_BSKH = proj("bsd,dkh->bskh", x_BSD, "wk_DKH", 1) + adapted(x_BSD, target="k")
        v_BSKH = proj("bsd,dkh->bskh", x_BSD, "wv_DKH", 2) + adapted(x_BSD, target="v")
        if cfg.attn_output_gate:
            q_BSNH, gate_BSNH = jnp.split(q_BSNH, 2, axis=-1)
        if cfg.qkv_bias:
            q_BSNH = q_BSNH + use(self.bq_NH, mesh, dt)
            k_BSKH = k_BSKH + use(self.bk_KH, mesh, dt)
            v_BSKH = v_BSKH + use(self.bv_KH, mesh, dt)
        if cfg.qk_norm:
            q_BSNH, k_BSKH = self.q_norm(q_BSNH), self.k_norm(k_BSKH)
        inv_freq, f = rope_frequencies(cfg, local=window is not None), rope_factor(cfg, local=window is not None)
        q_BSNH = constrain(apply_rope(q_BSNH, positions_BS, inv_freq, f), mesh, ("batch", "seq", "heads", "head_dim"))
        k_BSKH = constrain(apply_rope(k_BSKH, positions_BS, inv_freq, f), mesh,
                           ("batch", "seq", "kv_heads", "head_dim"))
        v_BSKH = constrain(v_BSKH, mesh, ("batch", "seq", "kv_heads", "head_dim"))
        o_BSNH = ulysses_attention(
            q_BSNH, k_BSKH, v_BSKH, mesh=mesh, axis_name=SP, ring_axis=RING, causal=True, segment_ids=segment_ids_BS,
            impl=cfg.attention_impl, permuted=True,  # with a ring, the model computes in its token order
            scale=cfg.attn_scale, window=window, max_documents=cfg.attn_max_documents, keep=cfg.attn_keep,
            sinks=use(self.sinks_N, mesh, jnp.float32) if cfg.attn_sinks else None,
        )
        if cfg.attn_output_gate:  # per head and dim, before the output projection
            o_BSNH = o_BSNH * jax.nn.sigmoid(gate_BSNH.astype(jnp.float32)).astype(o_BSNH.dtype)
        out_BSD = proj("bsnh,nhd->bsd", o_BSNH, "wo_NHD", 3) + adapted(o_BSNH, target="o")
        if cfg.o_bias:
            out_BSD = out_BSD + use(self.bo_D, mesh, dt)
        return constrain(out_BSD, mesh, ("batch", "seq", "embed"))
