"""The training step: one optimizer update (the job around it, loop and checkpoints, is ``trainer.py``).

AdamW with warmup + cosine decay and global-norm clipping, gradient accumulation normalised by tokens,
jitted with explicit shardings and the train state donated.

The train state is a dict ``{"params": nnx.State, "opt_state": optax state, "step": int32, "rng": key data}``.
With ``--fp8-recipe delayed``, ``params`` also holds the float8 amax histories (``fp8.History``): the step stores
the new history the backward returns (``fp8.py``) and gives the optimizer the rest, so they are checkpointed with the
parameters and take no optimizer state.
Parameters are born sharded (see ``model/layers.py``); the optimizer state is laid out like the parameters
(``optax.tree_map_params``), so both are split over the whole fsdp x sp (x data) group.

Gradient accumulation: a global batch of ``B`` rows is cut into ``A = grad_accum`` micro-batches
(row ``i`` goes to micro-batch ``i % A``, which keeps every micro-batch split over the batch mesh
axes); gradients of each micro-batch's *sum* of token losses are added in float32 (whatever the parameters'
dtype) and divided once by the token count of the whole batch. So ``A`` micro-batches give the same loss and
gradients as one batch of ``B`` rows, whatever the number of valid tokens in each micro-batch. The float32 sum
holds 4 bytes per parameter on the device while the micro-batches run (2 more than bfloat16 gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.model import fp8, lora
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.loss import next_token_loss
from ulysses_jax.model.transformer import Transformer
from ulysses_jax.parallel.mesh import DATA, FSDP, SEQ
from ulysses_jax.parallel.sharding import param_shardings
from ulysses_jax.train import optimizer

BATCH_KEYS = ("tokens", "labels", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float | None = None  # peak learning rate; None: 3e-3 from scratch, 2e-5 with --init-from-hf (FINE_TUNING)
    warmup_steps: int | None = None
    """linear warmup from 0; None: 10% of the decay steps from scratch, 3% of them (at least 1) with --init-from-hf"""
    decay_steps: int | None = None
    """step where the cosine reaches lr * min_lr_ratio; None: --steps when the run starts. A resumed run keeps
    its schedule, even with more --steps; given on resume, the rate decays anew from where it is (no jump)."""
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio, then stays there
    weight_decay: float | None = None  # AdamW decoupled weight decay; None: 0.1 from scratch, 0 with --init-from-hf
    clip_norm: float = 1.0  # global-norm gradient clipping (0: off)
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.95  # AdamW second-moment decay
    master_weights: bool = False
    """keep float32 master weights in the optimizer state and update those: for bfloat16 parameters (--param-dtype
    bfloat16), whose device copy is then the master rounded (``optimizer.py``)"""
    offload: bool = False
    """optimizer state (AdamW moments, master weights) in pinned host memory, streamed through the device one
    layer at a time by the update (``optimizer.py``)"""

    def __post_init__(self):
        checks = (
            ("lr", self.lr is None or self.lr > 0, "> 0"),
            ("warmup-steps", self.warmup_steps is None or self.warmup_steps >= 0, ">= 0"),
            ("decay-steps", self.decay_steps is None or self.decay_steps >= 1, ">= 1"),
            ("min-lr-ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("weight-decay", self.weight_decay is None or self.weight_decay >= 0, ">= 0"),
            ("clip-norm", self.clip_norm >= 0, ">= 0 (0: off)"),
            ("b1", 0 <= self.b1 < 1, "in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "in [0, 1)"),
        )
        for name, ok, need in checks:
            if not ok:
                value = getattr(self, name.replace("-", "_"))
                raise ValueError(f"--optim.{name} ({value}) must be {need}")

    def resolved(self, total_steps: int, *, fine_tuning: bool = False, lora: bool = False) -> OptimConfig:
        """The same settings with every ``None`` filled in for a run of ``total_steps``: the from-scratch defaults, or
        with ``fine_tuning`` (a pretrained start, ``--init-from-hf``) those of ``FINE_TUNING``, or with ``lora``
        (``--lora-rank``) those of ``LORA``."""
        return dataclasses.replace(self, **{k: v for k, (v, _) in self.defaults(total_steps, fine_tuning,
                                                                               lora).items()})

    def defaults(self, total_steps: int, fine_tuning: bool = False, lora: bool = False
                 ) -> dict[str, tuple[float | int, str]]:
        """``{field: (value, why)}`` for each setting left at ``None`` (not given), as ``resolved`` fills it in."""
        d = LORA if lora else FINE_TUNING if fine_tuning else SCRATCH
        fine_tuning = fine_tuning or lora
        out = {}
        decay = self.decay_steps
        if decay is None:
            decay = total_steps
            out["decay_steps"] = (decay, f"--steps {total_steps}")
        if self.warmup_steps is None:
            warmup = max(round(d["warmup_share"] * decay), 1 if fine_tuning else 0)
            out["warmup_steps"] = (warmup, f"{d['warmup_share']:.0%} of {decay} steps, derived from "
                                           f"{'--steps' if self.decay_steps is None else '--optim.decay-steps'}")
        for name in ("lr", "weight_decay"):
            if getattr(self, name) is None:
                out[name] = (d[name], d["why"])
        return out


# Defaults for settings not given (None). From scratch: this project's tiny-model recipe. Fine-tuning a pretrained
# model (--init-from-hf): the peak lr, weight decay and warmup share of Stanford Alpaca's train command (also LLaVA's
# and AllenAI open-instruct's Tulu 2 scripts): 2e-5, none, 3% of the steps; they clip the global gradient norm at 1.0
# (the Transformers Trainer's max_grad_norm), as --optim.clip-norm does. Not their b2 (0.999; ours stays 0.95) nor
# their cosine's end (0; ours 0.1 x lr): docs/huggingface.md says how to match those too.
SCRATCH = dict(lr=3e-3, weight_decay=0.1, warmup_share=0.1, why="from-scratch default")
FINE_TUNING = dict(lr=2e-5, weight_decay=0.0, warmup_share=0.03, why="fine-tuning default for --init-from-hf")
# LoRA (--lora-rank): the adapters' peak lr of the common recipes (the QLoRA paper's 2e-4 for 7B-13B models; TRL's and
# peft's examples use 1e-4 to 2e-4), with the fine-tuning warmup share and no weight decay.
LORA = dict(lr=2e-4, weight_decay=0.0, warmup_share=0.03, why="LoRA default for --lora-rank")


def describe_optim(optim: dict, defaults: dict) -> str:
    """The start-up line of a run's optimizer: ``optim`` as recorded (``run.json``'s ``config.optim``), each setting
    that was not given marked with where its value came from (``defaults``: the record's ``defaults``)."""
    def said(name: str, text: str) -> str:
        why = defaults.get(f"optim.{name}", {}).get("why")
        return f"{text} ({why})" if why else text

    lr, warmup, wd = optim["lr"], optim["warmup_steps"], optim["weight_decay"]
    steps = "step" if warmup == 1 else "steps"
    return (f"AdamW, {said('lr', f'peak lr {lr:g}')}, {said('warmup_steps', f'warmup {warmup} {steps}')}, cosine to "
            f"{optim['min_lr_ratio']:g} x lr at step {optim['decay_steps']}, "
            f"{said('weight_decay', f'weight decay {wd:g}')}, clip-norm {optim['clip_norm']:g} (--optim.* flags "
            f"override)")


def check_warmup(given: OptimConfig, decay_steps: int) -> None:
    """Refuse a warmup the user gave (``given.warmup_steps``) at or past the run's decay steps: ``make_schedule``
    would cut it to ``decay_steps - 1`` while the start line says the given one."""
    if given.warmup_steps is not None and given.warmup_steps >= decay_steps:
        flag = "--optim.decay-steps" if given.decay_steps is not None else "--steps"
        raise ValueError(f"--optim.warmup-steps ({given.warmup_steps}) must be below the decay steps ({decay_steps}, "
                         f"{flag}), where the rate falls from its peak; lower it or raise {flag}")


def make_schedule(cfg: OptimConfig, total_steps: int, replans: tuple[tuple[int, int], ...] = ()) -> optax.Schedule:
    """Linear warmup, cosine decay to ``lr * min_lr_ratio`` at ``decay_steps``, then constant.

    ``replans``: ``(step, decay_steps)`` pairs, in order: from ``step`` on, a cosine from the rate the schedule had
    there down to ``lr * min_lr_ratio`` at the new ``decay_steps`` (what ``--optim.decay-steps`` on resume does).
    """
    cfg = cfg.resolved(total_steps)
    warmup = min(cfg.warmup_steps, max(cfg.decay_steps - 1, 0))
    end = cfg.lr * cfg.min_lr_ratio
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.decay_steps, warmup + 1),
        end_value=end,
    )
    for start, decay in replans:
        schedule = _replanned(schedule, start, decay, end)
    return schedule


def _replanned(before: optax.Schedule, start: int, decay: int, end: float) -> optax.Schedule:
    start_lr = float(before(start))
    span = max(decay - start, 1)

    def schedule(step):
        frac = jnp.clip((step - start) / span, 0.0, 1.0)
        after = end + (start_lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < start, before(step), after)

    return schedule


def decay_mask(params):
    """Weight decay on matrices and embeddings (names ``w*``, ``embed*``, ``lm_head*``), not on norm
    scales or biases (which are stacked ``[L, ...]`` under the layer scan, so ``ndim`` cannot tell)."""

    def decays(path, _):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
        leaf = names[-1] if names else ""
        return leaf.startswith(("w", "embed", "lm_head"))

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
    cfg: OptimConfig, total_steps: int, replans: tuple[tuple[int, int], ...] = ()
) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW, as an ``optimizer.Optimizer`` (an optax transformation that names its parts,
    with master weights and host memory as ``cfg`` asks)."""
    cfg = cfg.resolved(total_steps)  # settings not given: the from-scratch defaults (a job resolves them before)
    adamw = optax.adamw(
        make_schedule(cfg, total_steps, replans), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    return optimizer.Optimizer.of(cfg.clip_norm, adamw, master_weights=cfg.master_weights, offload=cfg.offload)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[B, S]`` batch arrays: rows over ``("data", "fsdp")``, sequence over ``("ring", "sp")``."""
    return NamedSharding(mesh, P((DATA, FSDP), SEQ))


def _opt_shardings(tx, abstract_opt, param_shardings, mesh):
    if getattr(tx, "offload", False):
        return optimizer.host_shardings(tx, abstract_opt, _opt_shardings(tx.on_device, abstract_opt, param_shardings,
                                                                       mesh))
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )


def _opt_init(tx, config: ModelConfig, trained, shardings):
    """``(init, shardings)``: the optimizer state's ``init`` of the trained parameters and the parameter shardings
    its parameter-shaped parts follow; kept by layer where ``optimizer.layered`` says, and made into host memory
    where the state lives there (``--optim.offload``)."""
    if not getattr(tx, "offload", False):
        return tx.init, shardings
    if not optimizer.layered(tx, config.offload_params):
        return optimizer.initialised_in_host_memory(tx, tx.init), shardings
    return (optimizer.initialised_in_host_memory(tx, lambda p: tx.init(optimizer.per_layer(p))),
            optimizer.per_layer(shardings, like=trained))


def init_state(config: ModelConfig, mesh: Mesh, tx, seed: int, *, model: Transformer | None = None
               ) -> tuple[nnx.GraphDef, dict]:
    """A fresh train state, every array created in its final sharding.

    ``model``: start from these parameters (``hf.from_hf``: already in their shardings) instead of random ones; the
    optimizer state starts fresh either way.
    """
    if model is None:
        model = Transformer(config, mesh=mesh, rngs=nnx.Rngs(seed))
    elif model.config != config:
        raise ValueError(f"the starting model is {model.config}, not the configured {config}")
    graphdef, params = nnx.split(model)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    if config.offload_params:  # the stacked layers at rest in host memory
        shardings = optimizer.host_param_shardings(shardings)
        params = jax.device_put(params, shardings)
    # with adapters: those alone; never float8 scaling's histories
    trained, trained_sh = lora.split(fp8.split(params)[0])[0], lora.split(fp8.split(shardings)[0])[0]
    init, opt_sh = _opt_init(tx, config, trained, trained_sh)
    opt_state = jax.jit(init, out_shardings=_opt_shardings(tx, jax.eval_shape(init, trained), opt_sh, mesh))(trained)
    replicated = NamedSharding(mesh, P())
    state = {
        "params": params,
        "opt_state": opt_state,
        "step": jax.device_put(jnp.int32(0), replicated),
        "rng": jax.device_put(jax.random.key_data(jax.random.key(seed)), replicated),
    }
    return graphdef, state


def abstract_state(config: ModelConfig, mesh: Mesh, tx=None, seed: int = 0) -> tuple[nnx.GraphDef, dict]:
    """The train state as ``ShapeDtypeStruct``s carrying their shardings on ``mesh`` (nothing allocated).

    Without ``tx``: ``{"params": ...}`` alone (what ``eval`` restores).
    """
    abstract_model = nnx.eval_shape(lambda: Transformer(config, mesh=mesh, rngs=nnx.Rngs(seed)))
    graphdef, params = nnx.split(abstract_model)
    shardings = param_shardings(abstract_model, mesh)  # eval_shape drops shardings: read the metadata
    if config.offload_params:
        shardings = optimizer.host_param_shardings(shardings)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)
    if tx is None:
        return graphdef, {"params": params}
    trained = lora.split(fp8.split(params)[0])[0]  # with adapters: their optimizer state alone
    init, opt_sh = _opt_init(tx, config, trained, lora.split(fp8.split(shardings)[0])[0])
    abstract_opt = jax.eval_shape(init, trained)
    opt_shardings = _opt_shardings(tx, abstract_opt, opt_sh, mesh)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_opt,
                             opt_shardings)
    replicated = NamedSharding(mesh, P())
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    state = {
        "params": params,
        "opt_state": opt_state,
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        "rng": jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated),
    }
    return graphdef, state


def state_shardings(state: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, state)


def _loss_sums(graphdef, params, batch, dropout_key=None):
    """``(objective, sums)``: the sum of token losses (with experts plus ``coef x aux x count``, so that divided by the
    step's token count it is the mean loss plus ``coef x`` the token-weighted mean of the micro-batches' load-balancing
    losses) and the sums the metrics read: ``count``, the language-model ``lm_sum``, ``aux_sum`` (aux x count) and
    ``load`` (assignments per expert; empty without experts). ``dropout_key``: LoRA dropout's, while training."""
    model = nnx.merge(graphdef, params)
    out = next_token_loss(model, batch, dropout_key=dropout_key)
    if out.aux_loss is None:
        return out.sum, {**zero_sums(0), "count": out.count, "lm_sum": out.sum}
    aux_sum = out.aux_loss * out.count.astype(jnp.float32)
    objective = out.sum + model.config.router_aux_loss_coef * aux_sum
    return objective, dict(count=out.count, lm_sum=out.sum, aux_sum=aux_sum, load=out.expert_load)


def check_offload_params(offload_params: bool, tx, grad_accum: int) -> None:
    """``ModelConfig.offload_params`` needs the streamed update (``tx``: an ``OptimConfig`` or the optimizer made from
    one) and one micro-batch: else ``ValueError``."""
    if offload_params and not getattr(tx, "offload", False):
        raise ValueError("--offload-params needs --optim.offload: the update must stream the parameters and their "
                         "gradients from host memory layer by layer")
    if offload_params and grad_accum > 1:
        raise ValueError(f"--offload-params takes --grad-accum 1 (got {grad_accum}): gradients in host memory are "
                         f"not summed over micro-batches; use a longer --seq-len or a larger --batch-size instead")


def zero_sums(num_experts: int) -> dict:
    """``_loss_sums``' sums at zero, for a model with ``num_experts`` experts (0: dense)."""
    return dict(count=jnp.zeros((), jnp.int32), lm_sum=jnp.zeros((), jnp.float32), aux_sum=jnp.zeros((), jnp.float32),
                load=jnp.zeros((num_experts,), jnp.int32))


def accumulate(grad_fn, params, batch, grad_accum: int, mesh: Mesh, num_experts: int = 0, history=None):
    """``((objective, sums), gradients)`` of ``batch`` in ``grad_accum`` micro-batches (row ``i`` in micro-batch
    ``i % grad_accum``), the objectives, the sums (``_loss_sums``) and the gradients added, the gradients in float32
    whatever the parameters' dtype (bfloat16 sums would round at every micro-batch). ``grad_fn(params, micro)``:
    ``((objective, sums), gradients)``, ``grad_fn(params, micro, i)`` for micro-batch ``i``. With ``history`` (delayed
    float8 scaling's amax histories, ``fp8.split``) the gradients are ``(params', the histories' new values)``, and
    the micro-batches' new histories meet in a max (``fp8.combine``), not a sum."""
    micro_sharding = NamedSharding(mesh, P(None, (DATA, FSDP), SEQ))

    def split(x):  # [B, S] -> [A, B/A, S]; row i -> micro-batch i % A
        x = x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_sharding)

    def add(a, g):
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), a, g)

    def body(carry, xs):
        g_acc, s_acc = carry
        micro, index = xs
        out, g = grad_fn(params, micro, index)
        g_acc = add(g_acc, g) if history is None else (add(g_acc[0], g[0]), fp8.combine(g_acc[1], g[1]))
        return (g_acc, jax.tree.map(lambda a, x: a + x, s_acc, out)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if history is not None:
        zeros = (zeros, jax.tree.map(jnp.zeros_like, history))
    init = (zeros, (jnp.zeros((), jnp.float32), zero_sums(num_experts)))
    (grads, out), _ = jax.lax.scan(body, init, (jax.tree.map(split, batch), jnp.arange(grad_accum)))
    return out, grads


def make_train_step(graphdef, tx, schedule, mesh: Mesh, state_sh, *, grad_accum: int = 1):
    """``step(state, batch) -> (state, metrics)``, jitted, the state donated."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum ({grad_accum}) must be at least 1")
    # the parameters' gradients, and the new values of delayed float8 scaling's amax histories (None without)
    grad_of = jax.value_and_grad(lambda p, h, frozen, b, key: _loss_sums(graphdef, fp8.join(lora.join(p, frozen), h),
                                                                          b, key), argnums=(0, 1), has_aux=True)

    def step(state, batch):
        # with LoRA adapters only they are differentiated and updated; the frozen rest passes through unchanged
        params, history = fp8.split(state["params"])  # delayed float8: stored, not updated by the optimizer
        params, frozen = lora.split(params)
        model_cfg = nnx.merge(graphdef, state["params"]).config
        host_params = model_cfg.offload_params
        check_offload_params(host_params, tx, grad_accum)
        # LoRA's dropout: a key per step (and micro-batch) from the state's seed; None when nothing drops
        key = None
        if model_cfg.lora is not None and model_cfg.lora.dropout:
            key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        def grad_fn(p, b, i=0):  # the gradients, paired with the histories' new values where there are histories
            out, (g, h) = grad_of(p, history, frozen, b, None if key is None else jax.random.fold_in(key, i))
            return out, g if history is None else (g, h)

        if grad_accum == 1:
            (_, sums), grads = grad_fn(params, batch)
        else:
            (_, sums), grads = accumulate(grad_fn, params, batch, grad_accum, mesh, model_cfg.num_experts, history)
        grads, history = (grads, None) if history is None else grads
        count = sums["count"]
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        if grad_accum > 1:  # float32 sums divided in float32, then in the dtype the optimizer takes (below)
            master = isinstance(state["opt_state"], optimizer.MasterState)
            grads = jax.tree.map(lambda g, p: (g / denom).astype(jnp.float32 if master else p.dtype), grads, params)
        if getattr(tx, "offload", False):  # divides by the count itself, part by part on the device
            new_params, opt_state, grad_norm = optimizer.streamed_update(
                tx, grads, state["opt_state"], params, denom=denom if grad_accum == 1 else None,
                host_params=host_params)
        else:
            # each gradient keeps its parameter's dtype: a float32 quotient of bfloat16 gradients would make AdamW's
            # moments float32 after one step, and the new state would no longer fit the donated buffers
            if grad_accum == 1:
                grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
            new_params, opt_state = optimizer.apply(tx, grads, state["opt_state"], params)
            grad_norm = optimizer.norm_f32(grads)
        opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state["opt_state"])
        new_state = {
            "params": fp8.join(lora.join(new_params, frozen), history),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": state["rng"],
        }
        metrics = {
            "loss": sums["lm_sum"] / denom,  # the language model's; the load-balancing loss is logged apart
            "tokens": count,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
        }
        if sums["load"].size:  # experts: the load-balancing loss (unweighted) and the tokens each expert took
            metrics.update(aux_loss=sums["aux_sum"] / denom, expert_load=sums["load"])
        return new_state, metrics

    bsh = batch_sharding(mesh)
    return jax.jit(step, in_shardings=(state_sh, bsh), out_shardings=(state_sh, None), donate_argnums=0)


def make_eval_step(graphdef, mesh: Mesh, param_sh):
    """``eval_step(params, batch) -> (sum of token losses, count)`` over the global batch."""
    def eval_step(params, batch):
        sums = _loss_sums(graphdef, params, batch)[1]
        return sums["lm_sum"], sums["count"]

    return jax.jit(eval_step, in_shardings=(param_sh, batch_sharding(mesh)))
