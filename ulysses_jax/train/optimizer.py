"""Optimizer memory: float32 master weights, and the optimizer state in pinned host memory streamed by layer.

Two choices, each an ``OptimConfig`` flag (``step.py``):

  * ``master_weights``: the optimizer keeps a float32 copy of the parameters (``MasterState``) and updates it;
    the parameters the model computes with are that copy rounded to their own dtype. With bfloat16
    parameters the device holds 2 bytes per parameter for the model and the update is still float32's.
  * ``offload``: the optimizer state (AdamW's moments, and the master weights) lives in pinned host memory.
    The update streams it through the device: a loop over the stacked layers (a ``scan`` where the state is
    stacked, below) moves one layer's moments and master weights to the device, updates them there, and moves
    them back, so the device holds a layer or two of optimizer state at a time (the other parameters, embeddings
    and final norm, one array at a time). Stacks of different lengths (a hybrid's token mixers, each stacked over
    its own layers) get a loop each (``stack_groups``). Gradients are clipped first, over the whole model, on the
    device.

The state's layout in host memory (``layered``): each stacked parameter's state is a list of one array per layer
(``per_layer``), and the update is a loop over the layers unrolled in the program, so each layer's new state goes
back into the donated buffer it came from. Stacked, as a scan's inputs, the new state was a scan's outputs: new
stacks, a second copy of the whole state in host memory (77.6 GiB of 169 for Qwen3-8B at 32K on one H200: more
than the lent machine's 128 GiB); a scan updating stacks in place does not compile (below). With the stacked layers'
parameters in host memory too (``ModelConfig.offload_params``) the state stays stacked: the new parameters must be
new host stacks there, which only a scan's outputs give. A checkpoint of either layout resumes in the other
(``checkpoint.py``).

Both give the update of the plain on-device optimizer: the same optax transforms run on slices, and every
one of them is elementwise but the global-norm clip, which runs once on all gradients.

The moves between device and pinned host memory are ``model/host_offload.py``'s.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.model.host_offload import HOST, STACKED, to_device, to_host


class MasterState(NamedTuple):
    master: Any  # float32 copy of the parameters
    inner: Any  # the wrapped optimizer's state (of the float32 weights)


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` run on a float32 copy of the parameters held in its state (``MasterState``).

    ``update`` returns the updates of the float32 weights; the train step sets the parameters to the new master
    weights rounded to the parameters' dtype (``apply``), never adds the updates to low-precision parameters.
    """

    def init(params):
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return MasterState(master, tx.init(master))

    def update(grads, state, params=None):
        del params
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner = tx.update(grads, state.inner, state.master)
        return updates, MasterState(optax.apply_updates(state.master, updates), inner)

    return optax.GradientTransformation(init, update)


def _is_layers(x) -> bool:
    return isinstance(x, list)


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def _param_shaped(tx, state):
    """Per leaf of ``tx``'s ``state``: True for a parameter-shaped array (moments, master weights), False for the
    rest (step counts)."""
    return optax.tree_map_params(tx, lambda _: True, state, transform_non_params=lambda _: False)


def layered(tx, offload_params: bool) -> bool:
    """Whether ``tx``'s state keeps each stacked parameter's layers as separate arrays (``per_layer``): with the
    state in host memory (``offload``) and the stacked parameters on the device."""
    return bool(getattr(tx, "offload", False)) and not offload_params


def _layer_sharding(s):
    """The sharding of one layer of a stack sharded as ``s`` (its leading, layer axis is not sharded)."""
    if not isinstance(s, NamedSharding):
        return s
    if s.spec and s.spec[0] is not None:
        raise ValueError(f"a stacked parameter's layer axis is sharded ({s.spec}), so the optimizer state in host "
                         f"memory cannot be kept by layer: map \"layers\" to no mesh axis (parallel/sharding.py), or "
                         f"train without --optim.offload")
    return NamedSharding(s.mesh, P(*s.spec[1:]), memory_kind=s.memory_kind)


def _stack_sharding(s):
    return NamedSharding(s.mesh, P(None, *s.spec), memory_kind=s.memory_kind) if isinstance(s, NamedSharding) else s


def per_layer(tree, like=None):
    """``tree`` (parameters, their shardings or ``ShapeDtypeStruct``s, or an optimizer state holding such trees)
    with each stacked leaf (under ``blocks``) replaced by the list of its layers. ``like``: a tree of arrays or
    ``ShapeDtypeStruct``s of the same structure giving the stacks' lengths (needed for shardings)."""
    like = tree if like is None else like

    def split(x, ref, stacked):
        if not stacked:
            return x
        n = ref.shape[0]
        if _is_sharding(x):
            return [_layer_sharding(x)] * n
        if isinstance(x, jax.ShapeDtypeStruct):
            return [jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=_layer_sharding(x.sharding))] * n
        return [x[i] for i in range(n)]

    return jax.tree.map(split, tree, like, stacked_flags(like), is_leaf=_is_sharding)


def stacked_layers(tree):
    """``per_layer``'s inverse: each list of layers (arrays or ``ShapeDtypeStruct``s) stacked into one leaf."""

    def stack(x):
        if not _is_layers(x):
            return x
        if isinstance(x[0], jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(x), *x[0].shape), x[0].dtype, sharding=_stack_sharding(x[0].sharding))
        return jnp.stack(x)

    return jax.tree.map(stack, tree, is_leaf=_is_layers)


def is_layered(tree) -> bool:
    """Whether ``tree`` (an optimizer state) holds ``per_layer``'s lists."""
    return any(_is_layers(x) for x in jax.tree.leaves(tree, is_leaf=_is_layers))


def initialised_in_host_memory(tx, init):
    """``init`` (of ``tx``'s state) with the state's parameter-shaped arrays moved to host memory as they are made:
    the device then holds a few of them at a time (Qwen3-8B's float32 master weights and moments, 91.5 GiB: 11.4 GiB
    of device temporaries on a compile-only H200), not the whole state before it goes out."""

    def host_init(params):
        state = init(params)
        return jax.tree.map(lambda x, f: to_host(x) if f else x, state, _param_shaped(tx, state))

    return host_init


def other_layout(abstract):
    """``abstract`` (an optimizer state of ``ShapeDtypeStruct``s) in the other layout: stacked where it is kept by
    layer, by layer where stacked."""
    return stacked_layers(abstract) if is_layered(abstract) else per_layer(abstract)


def relayout(state, abstract):
    """``state`` (an optimizer state, or a part of one such as the master weights) laid out as ``abstract`` (the same
    state in the other layout, ``ShapeDtypeStruct``s with shardings): a checkpoint written with the state kept by
    layer resumed with it stacked, or the other way. One stacked parameter at a time: all its layers go through the
    device together (the largest of Qwen3-8B's, an MLP moment at fsdp 1, is 7.2 GB: a resume that converts needs
    that much device memory beside nothing else, as it runs before the first step) and out to ``abstract``'s memory
    (host or device); the inputs are donated. Slicing or stacking in host memory is what XLA does not compile."""
    on_device = lambda x: jax.device_put(x, jax.memory.Space.Device)  # noqa: E731  (a no-op for device arrays)
    sources = jax.tree.leaves(state, is_leaf=_is_layers)
    targets, treedef = jax.tree.flatten(abstract, is_leaf=_is_layers)
    out = []
    for x, t in zip(sources, targets, strict=True):
        if _is_layers(t):
            move = jax.jit(lambda x: [on_device(x)[i] for i in range(len(t))], out_shardings=[a.sharding for a in t],
                           donate_argnums=0)
        elif _is_layers(x):
            move = jax.jit(lambda xs: jnp.stack([on_device(x) for x in xs]), out_shardings=t.sharding,
                           donate_argnums=0)
        else:
            out.append(x)
            continue
        with warnings.catch_warnings():  # donated to be freed at once: a slice or stack cannot reuse the buffer
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            out.append(move(x))
    return jax.tree.unflatten(treedef, out)


class Optimizer(NamedTuple):
    """An optax ``GradientTransformation`` (``init``, ``update``) that also names its parts, for the streamed update."""

    init: Any
    update: Any
    clip_norm: float  # global-norm clipping (optax.clip_by_global_norm) before adamw; 0: none
    adamw: optax.GradientTransformation
    offload: bool  # state in pinned host memory, updated by ``streamed_update``
    on_device: optax.GradientTransformation  # the same transformation, as a plain optax one

    @classmethod
    def of(cls, clip_norm: float, adamw, *, master_weights: bool = False, offload: bool = False) -> Optimizer:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm else adamw
        if master_weights:
            tx = with_master_weights(tx)
        return cls(tx.init, tx.update, clip_norm, adamw, offload, tx)


def norm_f32(grads) -> jax.Array:
    """The gradients' global L2 norm in float32 (``optax.tree.norm`` adds each leaf's sum in the leaves' dtype: for
    bfloat16 gradients the logged norm kept three significant digits); the casts fuse into the reductions."""
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))


@jax.named_scope("optimizer")  # a profile's category (experiments/profile_step.py)
def apply(tx: optax.GradientTransformation, grads, opt_state, params):
    """One on-device optimizer update: ``(new params, new optimizer state)``."""
    updates, opt_state = tx.update(grads, opt_state, params)
    if isinstance(opt_state, MasterState):
        return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params), opt_state
    return optax.apply_updates(params, updates), opt_state


def stacked_flags(params):
    """True for each parameter stacked over the layers (under ``blocks``), False for the others."""

    def stacked(path, _):
        return any(isinstance(k, jax.tree_util.DictKey) and k.key == STACKED for k in path)

    return jax.tree_util.tree_map_with_path(stacked, params)


def stack_groups(params) -> list[int]:
    """Per leaf of ``params``: the length of its stack (its leading axis) for a stacked parameter, 0 for the others.
    The update scans each length's stacks together (a hybrid's token mixers are stacked over their own layers)."""
    return [x.shape[0] if f else 0 for x, f in zip(jax.tree.leaves(params), jax.tree.leaves(stacked_flags(params)))]


def _kinds(adamw, adam_state, params, groups) -> list:
    """Per leaf of ``adam_state`` (a list of layers counted as one): its parameter's ``stack_groups`` entry (a stack
    length, or 0: a parameter-shaped leaf of a parameter not stacked), or ``"scalar"``."""
    tree = jax.tree.unflatten(jax.tree.structure(params), groups)
    return jax.tree.leaves(optax.tree_map_params(adamw, lambda _, g: g, adam_state, tree, is_leaf=_is_layers,
                                                 transform_non_params=lambda _: "scalar"))


def _fill(values, like, mask):
    """``like``'s positions: the next of ``values`` where ``mask``, else an empty array of ``like``'s dtype (the
    optax transforms run on every leaf; an empty one costs nothing and keeps the tree and its names whole)."""
    it = iter(values)
    return [next(it) if m else jnp.zeros((0,), (x[0] if _is_layers(x) else x).dtype) for x, m in zip(like, mask)]


# Layers whose update the unrolled loop (loop_layers) lets run at once: each layer's inputs wait for the outputs of the
# layer this many before it. Unchained, XLA's scheduler ran many layers' updates together: Mixtral-8x7B at 1M tokens on
# 8 compile-only H100s (--remat offload --attn-keep, host optimizer) peaked in the update at 46.22 GiB of device
# temporaries, 41.72 with the scan; chained at 2 (the scan's double buffering), 41.74; at 1, 42.00 (41.72 at 2 since
# each layer's slices are taken after its barrier).
IN_FLIGHT = 2


def _sum_of_squares(stacked, prep):
    """float32 sum of squares of the stacked arrays' slices, each ``prep``-ed, one layer at a time (a ``scan``)."""

    def body(total, xs):
        return total + sum(jnp.sum(jnp.square(prep(x).astype(jnp.float32))) for x in xs), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), stacked)[0]


@jax.named_scope("optimizer")
def streamed_update(tx: Optimizer, grads, opt_state, params, *, denom=None, host_params: bool = False):
    """``tx``'s update (global-norm clipping, AdamW, with master weights or not) with the optimizer state in host
    memory: ``(new params, new optimizer state, gradient norm)``.

    Layer by layer for the stacked parameters (a loop unrolled in the program where the state is kept by layer,
    ``per_layer``; a ``scan`` where it is stacked: a layer or two of state on the device at a time), then the
    other parameters one array at a time. ``grads`` are divided by ``denom`` (the token count; ``None``: already
    done) as each part reaches the device, and stay in their dtype until a layer's update casts them.
    ``host_params`` (``ModelConfig.offload_params``): the stacked parameters and their gradients are in host memory;
    the gradients stream in for the norm and again for the update, the new parameters go back out layer by layer.
    """
    adamw, clip_norm = tx.adamw, tx.clip_norm
    master = isinstance(opt_state, MasterState)
    chain_state = opt_state.inner if master else opt_state
    clip_state, adam_state = chain_state if clip_norm else (None, chain_state)
    weights = opt_state.master if master else params

    def prep(g):  # on the device, divided by the token count, in its own dtype
        g = to_device(g) if host_params else g
        return g if denom is None else (g / denom).astype(g.dtype)

    def seen(g):  # a gradient in the dtype the optimizer works in: float32 for the master weights
        return g.astype(jnp.float32) if master else g

    p_leaves, p_def = jax.tree.flatten(params)
    groups = stack_groups(params)
    lengths = sorted(set(groups) - {0})  # one scan per stack length
    if host_params:  # the stacked gradients stream through the device for the norm: float32 sums of squares
        g_all = jax.tree.leaves(grads)
        squares = sum(_sum_of_squares([g for g, n in zip(g_all, groups) if n == length], prep) for length in lengths)
        squares += sum(jnp.sum(jnp.square(prep(g).astype(jnp.float32))) for g, n in zip(g_all, groups) if not n)
        grad_norm = seen_norm = jnp.sqrt(squares)
    else:
        grads = jax.tree.map(prep, grads)
        prep = lambda g: g  # noqa: E731  (done)
        grad_norm = norm_f32(grads)  # the master weights' optimizer sees float32 gradients: the same norm
        seen_norm = (grad_norm if master else optax.tree.norm(grads)) if clip_norm else None
    if clip_norm:  # optax.clip_by_global_norm: its norm over the whole model once, its scaling per part
        trigger = jnp.squeeze(seen_norm < clip_norm)

        def clipped(g):
            g = seen(prep(g))
            return jax.lax.select(trigger, g, (g / seen_norm.astype(g.dtype)) * clip_norm)
    else:
        def clipped(g):
            return seen(prep(g))
    layers = is_layered(adam_state)  # per_layer's lists: the loop below, not the scan
    if layers and host_params:
        raise ValueError("the optimizer state is kept by layer (per_layer), but --offload-params streams stacks: "
                         "make the state with optimizer.layered(tx, offload_params=True), which keeps it stacked")
    g_leaves, w_leaves = jax.tree.leaves(grads), jax.tree.leaves(weights, is_leaf=_is_layers)
    s_leaves, s_def = jax.tree.flatten(adam_state, is_leaf=_is_layers)
    g_seen = [jax.ShapeDtypeStruct((), jnp.float32 if master else x.dtype) for x in g_leaves]  # dtypes only
    kinds = _kinds(adamw, adam_state, params, groups)

    def run(g, st, w, part: int):
        """adamw on one part (``part``: a stack length, one layer of those stacks; 0: the parameters not stacked): the
        given leaves (lists over that part) moved in, updated, the state moved out."""
        p_mask = [n == part for n in groups]
        s_mask = [k == part for k in kinds]
        st_full = [x if k == "scalar" else y for x, y, k in zip(s_leaves, _fill(st, s_leaves, s_mask), kinds)]
        w_full = p_def.unflatten(_fill(to_device(w), w_leaves, p_mask))
        g = [clipped(x) for x in g]
        updates, new = adamw.update(p_def.unflatten(_fill(g, g_seen, p_mask)),
                                    s_def.unflatten(to_device(st_full)), w_full)
        new_w = jax.tree.leaves(optax.apply_updates(w_full, updates))
        new_s = jax.tree.leaves(new)
        return ([x for x, m in zip(new_w, p_mask) if m], [to_host(x) for x, m in zip(new_s, s_mask) if m],
                [x for x, k in zip(new_s, kinds) if k == "scalar"])

    def pick(xs, mask):
        return [x for x, m in zip(xs, mask) if m]

    # Stacked (--offload-params), the state's stacks in host memory are the scan's outputs: new stacks, a second copy
    # of the stacked state in host memory (XLA's buffer report); a loop updating them in place (dynamic_update_slice
    # into host memory) does not compile for the compile-only H100 target (XLA: a host-to-host copy-start), so that
    # copy stays there (kept by layer, loop_layers has none). The parameters' stacks on the device are updated in
    # place instead (the loop's carry, the donated parameters): as scan outputs
    # they were zeros buffers that XLA created with the gradients' before the backward, 15 GiB held through it on
    # one H100 for Llama-3.1-8B.
    in_place = not host_params
    weights_in_stacks = in_place and not master  # the weights are the parameters being updated: read from the carry

    def scan_layers(length: int):
        """The update of the stacks of ``length`` layers, one layer at a time: (new params, new master weights,
        new state), each a list over those stacks."""
        flags = [n == length for n in groups]
        layer_params = pick(p_leaves, flags)

        def body(carry, xs):  # one layer of the stacked parameters
            i, stacks = carry
            g, st, w = xs
            if weights_in_stacks:
                w = [jax.lax.dynamic_index_in_dim(p, i, keepdims=False) for p in stacks]
            w, st, _ = run(g, st, w, length)
            new_p = [x.astype(p.dtype) for x, p in zip(w, layer_params)]
            if in_place:
                stacks = [jax.lax.dynamic_update_index_in_dim(p, x, i, axis=0) for p, x in zip(stacks, new_p)]
                new_p = []
            return (i + 1, stacks), (to_host(new_p) if host_params else new_p, to_host(w) if master else [], st)

        xs = (pick(g_leaves, flags), pick(s_leaves, [k == length for k in kinds]),
              [] if weights_in_stacks else pick(w_leaves, flags))
        (_, stacks), (p_layers, m_layers, s_layers) = jax.lax.scan(
            body, (jnp.zeros((), jnp.int32), layer_params if in_place else []), xs)
        return stacks if in_place else p_layers, m_layers, s_layers

    def loop_layers(length: int):
        """``scan_layers`` for a state kept by layer: a loop unrolled in the program. Each layer's new state and
        master weights go to host memory as outputs of their own, which XLA writes into the donated inputs they
        came from: no second copy of the state (a scan's outputs are new stacks). The parameters' stacks on the
        device are updated in place, one layer at a time."""
        flags = [n == length for n in groups]
        stacks, g_stacks = pick(p_leaves, flags), pick(g_leaves, flags)
        states, masters = pick(s_leaves, [k == length for k in kinds]), pick(w_leaves, flags) if master else []
        new_m, new_s = [], []
        for i in range(length):
            w, st = [m[i] for m in masters], [x[i] for x in states]  # (masters: [] without master weights)
            if i >= IN_FLIGHT:  # this layer's inputs wait for the outputs of the layer IN_FLIGHT before it
                (w, st, g_stacks, stacks), _ = jax.lax.optimization_barrier(
                    ((w, st, g_stacks, stacks), (new_m[i - IN_FLIGHT], new_s[i - IN_FLIGHT])))
            # the stacks are sliced after the barrier: sliced before it, XLA made every layer's slice of the gradient
            # (and its float32 copy) in one fusion ahead of the loop, all alive at once
            if not master:
                w = [p[i] for p in stacks]
            w, st, _ = run([g[i] for g in g_stacks], st, w, length)
            stacks = [jax.lax.dynamic_update_index_in_dim(p, x.astype(p.dtype), i, axis=0) for p, x in zip(stacks, w)]
            new_m.append(to_host(w) if master else [])
            new_s.append(st)
        return stacks, [list(x) for x in zip(*new_m)], [list(x) for x in zip(*new_s)]

    stacked = {length: (loop_layers if layers else scan_layers)(length) for length in lengths}
    rest = [not n for n in groups]
    w_rest, s_rest, scalars = run(pick(g_leaves, rest), pick(s_leaves, [k == 0 for k in kinds]), pick(w_leaves, rest),
                                  0)

    def merge(part: int, rest):  # per parameter: the next of its stack length's ``part`` (of scan_layers), or of rest
        its = {n: iter(out[part]) for n, out in stacked.items()} | {0: iter(rest)}
        return [next(its[n]) for n in groups]

    its = {n: iter(out[2]) for n, out in stacked.items()} | {0: iter(s_rest), "scalar": iter(scalars)}
    new_s = [next(its[k]) for k in kinds]
    new_adam = s_def.unflatten(new_s)
    new_chain = (clip_state, new_adam) if clip_norm else new_adam
    p_rest = [x.astype(p.dtype) for x, p in zip(w_rest, pick(p_leaves, rest))]
    new_params = p_def.unflatten(merge(0, p_rest))
    if not master:
        return new_params, new_chain, grad_norm
    new_master = p_def.unflatten(merge(1, to_host(w_rest)))
    return new_params, MasterState(new_master, new_chain), grad_norm


def host_param_shardings(shardings):
    """Parameter ``shardings`` with the stacked layers' (``ModelConfig.offload_params``) in pinned host memory."""

    def host(s, stacked):
        return NamedSharding(s.mesh, s.spec, memory_kind=HOST) if stacked and isinstance(s, NamedSharding) else s

    return jax.tree.map(host, shardings, stacked_flags(shardings), is_leaf=_is_sharding)


def host_shardings(tx, abstract_opt, shardings):
    """``shardings`` of the optimizer state with its parameter-shaped arrays in pinned host memory.

    On devices without that memory kind (compile-only GPUs), JAX drops it and the sharding is unchanged.
    """

    def host(s):
        return NamedSharding(s.mesh, s.spec, memory_kind=HOST) if isinstance(s, NamedSharding) else s

    return jax.tree.map(lambda s, f: host(s) if f else s, shardings, _param_shaped(tx, abstract_opt),
                        is_leaf=_is_sharding)
