"""The searches of ``ulysses-jax plan``: the longest context within both budgets (``--find-max-seq-len``) and the
memory tools of ``--memory auto``.

A plan's memory grows about linearly with the sequence length, so the length search is a secant search on the
budget used (``usage``: the larger of device total / device budget and host bytes / host budget): two compiles
predict the boundary, each further compile lands just below the predicted one, bisection takes over where the
prediction leaves the bracket. It stops when the bracket is within ``RESOLUTION`` (1%) of the length found, or one
unit (``seq_len_unit``): about 4 compiles instead of the 2 log2(answer) of a bisection to one unit. Every length it
reports has been compiled and verified within both budgets. ``--memory auto`` starts each set of memory tools at
the longest length found so far: a set that does not fit there cannot win and costs one compile.

Each compile is reported to ``on_trial`` as it finishes (``run.py`` writes them into the JSON file), so an
interrupted search keeps what it found.
"""

from __future__ import annotations

import dataclasses
import math

from ulysses_jax.plan.planner import MAX_SEQ_LEN, Plan, PlanConfig, _mesh, _model, budgets, plan
from ulysses_jax.plan.report import gib
from ulysses_jax.plan.targets import get_target
from ulysses_jax.train.devices import MeshConfig

RESOLUTION = 0.01  # the length search stops when the boundary is bracketed within 1% of the length found
TILE = 4096  # the chunk --memory auto tiles the loss, the MLP and the attention sublayer with, where it divides
MIN_TILE = 256  # ... or the largest divisor of each device's sequence between this and TILE


class NothingFits(ValueError):
    """``--memory auto`` found no set of memory tools within the budgets: a verdict (OVER), not a bad input."""


def usage(p: Plan) -> float:
    """The budget a plan uses: the larger of device total / device budget and host bytes / host budget (<= 1: fits)."""
    m = p.memory
    host = m["host_bytes"] / m["host_budget_bytes"] if m["host_budget_bytes"] else (math.inf if m["host_bytes"] else 0)
    return max(m["total_bytes"] / m["budget_bytes"], host)


def seq_len_unit(cfg: PlanConfig, sp: int) -> int:
    """The step of the search: sequence lengths divisible by sp, each device's part by the chunk sizes and 128."""
    chunk = math.lcm(128, cfg.loss_chunk or 1, cfg.mlp_chunk or 1, cfg.attn_chunk or 1)
    return sp * chunk


def search_units(measure, *, start: int, max_units: int, resolution: float = RESOLUTION) -> int:
    """The largest ``n`` in ``[0, max_units]`` with ``measure(n) <= 1``, to within ``resolution`` of it (and one unit),
    for ``measure`` increasing in ``n`` (about affine): ``measure(result) <= 1`` and ``measure(m) > 1`` was seen for
    some ``m <= max(result + 1, (1 + resolution) * result)``, unless the result is ``max_units``.
    """
    lo, hi = 0, max_units + 1  # lo fits (0 trivially), hi does not
    seen: dict[int, float] = {}
    n = min(max(start, 1), max_units)
    while True:
        seen[n] = u = measure(n)
        lo, hi = (max(lo, n), hi) if u <= 1 else (lo, min(hi, n))
        step = max(1, int(resolution * lo))
        if hi - lo <= step or lo == max_units:
            return lo
        n = _next_guess(seen, lo, hi, step, max_units)


def _next_guess(seen: dict[int, float], lo: int, hi: int, step: int, max_units: int) -> int:
    """Where to compile next: just under the secant's boundary through the two points nearest to it, inside
    ``(lo, hi)``; a closing probe at ``lo + step`` when that is where the boundary is; else bisect (or double)."""
    near = sorted(seen, key=lambda k: abs(seen[k] - 1))[:2]
    guess = None
    if len(near) == 2:
        (a, ua), (b, ub) = ((k, seen[k]) for k in near)
        if (ub - ua) * (b - a) > 0:  # usage grows with the length: the secant points at the boundary
            guess = a + (1 - ua) * (b - a) / (ub - ua)
    if guess is None:  # one point, a flat stretch, or usage that fell as the length grew (XLA chose other buffers at
        # a short length: a secant sloping down would crawl one step at a time): proportional from the longest seen, and
        a = max(seen)  # while nothing was over the budgets, at least double, as a bracketing search would
        guess = a / seen[a] if seen[a] > 0 else 2 * a
        guess = max(guess, 2 * lo) if hi > max_units else guess
    guess = math.floor(guess - step / 2)  # aim just below: a fitting length moves lo, the answer
    if guess <= lo:
        guess = lo + step  # the boundary is within a step of lo: close the bracket
    if not lo < guess < hi:
        guess = (lo + hi) // 2 if hi <= max_units else min(2 * max(lo, 1), max_units)
    return min(max(guess, lo + 1), hi - 1, max_units)


def find_max_seq_len(cfg: PlanConfig, *, log=print, on_trial=None, floor: int = 0, detail: bool = True) -> Plan:
    """The plan at the longest sequence length within both budgets (``max_seq_len`` set; 0 when even one unit does
    not fit). ``floor``: a length found by another search; when this one does not fit at it, it stops there with
    ``max_seq_len`` None. ``detail``: compile the answer again with its largest buffers and kernels."""
    _, mesh = _mesh(cfg, _model(cfg), cfg.seq_len)
    # the mesh the search plans on: resolved once, so that an automatic --mesh.sp does not change with the length
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(**{a: mesh.shape[a] for a in ("data", "fsdp", "ring", "sp")}))
    unit = seq_len_unit(cfg, mesh.shape["ring"] * mesh.shape["sp"])  # the sequence splits over ring x sp
    trials: dict[int, Plan] = {}

    def measure(n_units: int) -> float:
        if n_units in trials:  # the floor, measured before the search starts there
            return usage(trials[n_units])
        p = plan(cfg, seq_len=n_units * unit, detail=False)
        trials[n_units] = p
        log(f"  seq_len {n_units * unit:>11,}: {gib(p.memory['total_bytes'])} GiB per device, "
            f"{gib(p.memory['host_bytes'])} GiB host ({'fits' if p.fits else 'over'}; {p.compile_seconds:.0f} s)")
        if on_trial is not None:
            on_trial(p)
        return usage(p)

    floor_units = -(-floor // unit)  # the shortest length of this set's step at or past the floor
    if floor >= unit and measure(floor_units) > 1:  # over at a length found already: this set cannot win
        best = trials[floor_units]
        best.max_seq_len = None
        return best
    # from --seq-len where it is longer (it need not fit: the search comes down to the floor, which does)
    best_units = search_units(measure, start=max(floor_units, cfg.seq_len // unit, 1), max_units=MAX_SEQ_LEN // unit)
    if detail:
        best = plan(cfg, seq_len=max(best_units, 1) * unit)
    else:
        best = trials.get(max(best_units, 1)) or plan(cfg, seq_len=max(best_units, 1) * unit, detail=False)
    best.max_seq_len = best_units * unit
    return best


# ------------------------------------------------------------------------------------ --memory auto


def tile_for(local_seq: int | None, prefer: int = TILE) -> int | None:
    """``prefer`` if it divides ``local_seq`` (or no length is fixed), else the largest divisor of ``local_seq``
    between ``MIN_TILE`` and ``prefer``; None where none does."""
    if local_seq is None or local_seq % prefer == 0:
        return prefer
    return next((d for d in range(min(prefer, local_seq), MIN_TILE - 1, -1) if local_seq % d == 0), None)


def memory_choices(cfg: PlanConfig, num_layers: int, local_seq: int | None = None, post_norms: bool = False,
                   o_bias: bool = False, mixed_kinds: bool = False, delta: bool = False,
                   experts: bool = False) -> list[tuple[str, dict, str | None]]:
    """``(train flags, PlanConfig changes, why skipped or None)`` of each set of memory tools ``--memory auto``
    tries (with ``--attn-keep``: attention's output kept, its forward run once, on the device or in host memory).
    ``local_seq``: each device's tokens when the length is fixed; the chunk sizes are chosen to divide it
    (``tile_for``), and a set is skipped with the reason where none does. ``post_norms`` (Gemma 3): no set with
    ``attn_recompute``, which such a model refuses; ``o_bias`` (gpt-oss): the tiled attention sets are skipped (it
    takes no output-projection bias); ``mixed_kinds`` (local and global layers, or delta-net and attention layers):
    the kept attention is not offloaded (``ModelConfig`` refuses it); ``delta`` (delta-net layers: Qwen3.5,
    Qwen3-Next): the tiled sets run the delta-net in groups of one value head per device too; ``experts`` (routed
    experts): no set with ``--mlp-keep``, which keeps a dense MLP's products."""
    k = min((d for d in range(2, num_layers + 1) if num_layers % d == 0), key=lambda d: abs(d - math.sqrt(num_layers)),
            default=1)
    tile = tile_for(local_seq, cfg.attn_chunk or cfg.mlp_chunk or TILE)
    tiles, tile_flags = {}, ""
    no_tile = (f"no chunk between {MIN_TILE} and {TILE} tokens divides each device's {local_seq:,} tokens"
               if tile is None else None)
    for name in ("loss_chunk", "mlp_chunk"):  # the tiled loss and MLP, unless the flags set them
        if getattr(cfg, name) is None and tile is not None:
            tiles[name] = tile
            tile_flags += f" --{name.replace('_', '-')} {tile}"
    host = dict(param_dtype="bfloat16", optim=dataclasses.replace(cfg.optim, master_weights=True, offload=True))
    host_flags = "--param-dtype bfloat16 --optim.master-weights --optim.offload"
    if cfg.lora_rank is not None:  # LoRA: a frozen bfloat16 base and the adapters' small optimizer on the devices
        host, host_flags = {}, ""
    choices = [(f"--remat full{tile_flags}", dict(remat="full", remat_every=None, **tiles), None)]
    keep = cfg.mesh.ring <= 1 and not cfg.attn_chunk  # attention's output kept: its forward runs once (kept.py)
    if keep:
        choices.append((f"--remat full --attn-keep{tile_flags}", dict(remat="full", remat_every=None, attn_keep=True,
                                                                      **tiles), None))
        # the matmuls' outputs kept too, the MLP untiled (unless the flags tile it) so that its GEMMs' are: the
        # backward re-runs no GEMM; the fastest set measured where it fits (llama3.2-1b at 32K on one H100: 1.207 s
        # against 1.312 for the one above, 55 GiB against 33; experiments/results/peers_h100_20261127.csv)
        save = {**tiles, "mlp_chunk": 0} if cfg.mlp_chunk is None else dict(tiles)
        save_flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in save.items())
        if not experts:  # between the two: the MLP's gate and up kept, its GEMMs run once (half of SAVE's keeps,
            # for an 8B model at 32K on one H200 the one of the three that fits without XLA re-running GEMMs itself)
            choices.append((f"--remat full --attn-keep --mlp-keep{save_flags}",
                            dict(remat="full", remat_every=None, attn_keep=True, mlp_keep=True, **save),
                            f"--mlp-keep keeps the untiled MLP's products, and --mlp-chunk {cfg.mlp_chunk} is given"
                            if cfg.mlp_chunk else None))
        choices.append((f"--remat save_matmuls --attn-keep{save_flags}",
                        dict(remat="save_matmuls", remat_every=None, attn_keep=True, **save), None))
    if k > 1:
        choices.append((f"--remat full --remat-every {k}{tile_flags}", dict(remat="full", remat_every=k, **tiles),
                        None))
    choices.append((f"--remat offload {host_flags}{tile_flags}", dict(remat="offload", remat_every=None, **host,
                                                                      **tiles), None))
    if keep:  # the kept output beside each layer's input in pinned host memory
        choices.append((f"--remat offload --attn-keep {host_flags}{tile_flags}",
                        dict(remat="offload", remat_every=None, attn_keep=True, **host, **tiles),
                        "kept attention is not offloaded from a model mixing layer kinds (local, global or linear "
                        "layers)" if mixed_kinds else None))
    if num_layers % 2 == 0:
        choices.append((f"--remat offload --remat-every 2 {host_flags}{tile_flags}",
                        dict(remat="offload", remat_every=2, **host, **tiles), None))
    if cfg.mesh.ring <= 1:  # the tiled attention sublayer tiles the Ulysses exchange of a mesh without a ring
        tiled = f"--attn-chunk {tile} --attn-head-chunk 1"  # one query head per group: the smallest kernel buffers
        tiled += " --delta-head-chunk 1" if delta else ""
        tiled_skip = "the tiled attention sublayer takes no output-projection bias (gpt-oss)" if o_bias else no_tile
        attn = dict(attn_chunk=tile, attn_head_chunk=1, **({"delta_head_chunk": 1} if delta else {}), **tiles)
        choices.append((f"--remat offload {host_flags} {tiled}{tile_flags}",
                        dict(remat="offload", remat_every=None, **host, **attn), tiled_skip))
        if num_layers % 2 == 0 and not post_norms:  # two layers' inputs on the device in a group's backward: no
            # attention output there (refused with post_norms: the post-attention norm's backward reads it)
            choices.append((f"--remat offload --remat-every 2 {host_flags} {tiled} --attn-recompute{tile_flags}",
                            dict(remat="offload", remat_every=2, attn_recompute=True, **host, **attn), tiled_skip))
        if k > 1 and not post_norms:  # every layer's input in host memory, a group's too: L/k + L offloads
            choices.append((f"--remat offload --remat-every {k} --remat-nested {host_flags} {tiled} --attn-recompute"
                            f"{tile_flags}", dict(remat="offload", remat_every=k, remat_nested=True,
                                                  attn_recompute=True, **host, **attn), tiled_skip))
    # each set says whether it nests (a --remat-nested given with --memory auto does not leak into the others)
    return [(" ".join(flags.split()), {"remat_nested": False, **changes}, skip) for flags, changes, skip in choices]


def _summary(flags: str, p: Plan | None, *, length: int | None, note: str = "") -> dict:
    e = (p.estimate or {}) if p is not None else {}
    return {"flags": flags, "seq_len": length, "fits": None if p is None else p.fits,
            "device_bytes": None if p is None else p.memory["total_bytes"],
            "host_bytes": None if p is None else p.memory["host_bytes"],
            "step_seconds": e.get("step_seconds"), "tokens_per_second_per_gpu": e.get("tokens_per_second_per_gpu"),
            "note": note}


def _choose(cfg: PlanConfig, p: Plan, flags: str, changes: dict) -> Plan:
    """The chosen set's plan again with the detail (largest buffers, kernels), its flags and runners-up set."""
    best = plan(dataclasses.replace(cfg, memory="manual", **changes), seq_len=p.seq_len)
    best.max_seq_len, best.memory_flags, best.memory_changes = p.max_seq_len, flags, changes
    return best


def auto_memory(cfg: PlanConfig, *, log=print, on_trial=None) -> Plan:
    """``--memory auto --find-max-seq-len``: the longest context within both budgets over ``memory_choices``; between
    sets that reach the same length, the lowest estimated step time (``_fastest``: where memory is tight, within 2% of
    it the least memory)."""
    tied, results = [], []  # the sets that reach the longest length so far
    model = _model(cfg)
    _, mesh = _mesh(cfg, model, cfg.seq_len)  # resolved once, as each set's search does: the answer is planned on it
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(**{a: mesh.shape[a] for a in ("data", "fsdp", "ring", "sp")}))
    choices = memory_choices(cfg, model.num_layers, post_norms=model.post_norms, o_bias=model.o_bias,
                             mixed_kinds=model.mixed_layer_kinds, delta=bool(model.linear_layers),
                             experts=bool(model.num_experts))
    for flags, changes, skip in sorted(choices, key=lambda c: "attn-chunk" not in c[0]):  # the longest reaching first
        if skip:
            log(f"{flags}: skipped ({skip})")
            continue
        log(f"{flags}:")
        floor = tied[0][0].max_seq_len if tied else 0
        p = find_max_seq_len(dataclasses.replace(cfg, memory="manual", **changes), log=log, on_trial=on_trial,
                             floor=floor, detail=False)
        if p.max_seq_len is None:
            results.append(_summary(flags, p, length=None, note=f"over the budgets at {floor:,} (shorter)"))
            continue
        results.append(_summary(flags, p, length=p.max_seq_len))
        if p.max_seq_len > floor:
            tied = [(p, flags, changes)]
        elif p.max_seq_len and p.max_seq_len == floor:
            tied.append((p, flags, changes))
    if not tied:
        raise NothingFits("no set of memory tools fits even one unit of the sequence on these devices within the "
                         f"device and host budgets (host: {gib(cfg_host_budget(cfg))} GiB per GPU); plan more devices "
                         f"or raise --host-memory-gib")
    best = _fastest(tied)
    chosen = _choose(cfg, *best)
    chosen.alternatives = [r for r in results if r["flags"] != best[1]]
    log_alternatives(chosen, log)
    return chosen


def cfg_host_budget(cfg: PlanConfig) -> int:
    return budgets(cfg, get_target(cfg.target))[2]


def auto_fit(cfg: PlanConfig, *, log=print, on_trial=None, detail: bool = True) -> Plan:
    """``--memory auto`` for ``--seq-len``: of ``memory_choices`` that fit both budgets, the one with the lowest
    estimated step time (``_fastest``: where memory is tight, within 2% of it the least memory); the others are
    printed as runners-up. On one GPU that set is compiled once more with the layer loop unrolled and, where it fits,
    joins the others before the rule picks again (``unrollable``). ``detail``: compile the chosen set again with its
    largest buffers and kernels (``train --memory auto`` takes the trial's plan as it is)."""
    model = _model(cfg)
    _, mesh = _mesh(cfg, model, cfg.seq_len)
    local = cfg.seq_len // (mesh.shape["ring"] * mesh.shape["sp"]) if cfg.seq_len % (
        mesh.shape["ring"] * mesh.shape["sp"]) == 0 else None
    fitting, results = [], []
    for flags, changes, skip in memory_choices(cfg, model.num_layers, local, post_norms=model.post_norms,
                                                 o_bias=model.o_bias, mixed_kinds=model.mixed_layer_kinds,
                                                 delta=bool(model.linear_layers), experts=bool(model.num_experts)):
        if skip is not None:
            log(f"  skipped: {flags}: {skip}")
            results.append(_summary(flags, None, length=cfg.seq_len, note=f"skipped: {skip}"))
            continue
        p = _trial(cfg, flags, changes, log, on_trial)
        results.append(_summary(flags, p, length=cfg.seq_len))
        if p.fits:
            fitting.append((p, flags, changes))
    if not fitting:
        raise NothingFits(f"no set of memory tools fits --seq-len {cfg.seq_len} on these devices within the device and "
                         f"host budgets (host: {gib(cfg_host_budget(cfg))} GiB per GPU); plan more devices, or find "
                         f"the longest that fits with --find-max-seq-len")
    p, flags, changes = _fastest(fitting)
    if unrollable(cfg, p, changes):  # the winner with its layer loop unrolled: one compile more
        flags_u, changes_u = f"{flags} --scan-unroll", {**changes, "scan_unroll": True}
        u = _trial(cfg, flags_u, changes_u, log, on_trial)
        results.append(_summary(flags_u, u, length=cfg.seq_len))
        if u.fits:
            fitting.append((u, flags_u, changes_u))
            p, flags, changes = _fastest(fitting)
    if detail:
        chosen = _choose(cfg, p, flags, changes)
    else:
        chosen = p
        chosen.memory_flags, chosen.memory_changes = flags, changes
    chosen.alternatives = [r for r in results if r["flags"] != flags]
    log(f"Chosen (--memory auto): the lowest estimated step time of the {len(fitting)} sets that fit, each listed "
        f"above (of those within {NEAR:.0%} of it, the fastest needing no host memory and at most {ROOMY:.0%} of the "
        f"device budget; where none does, the one needing the least memory): {flags}")
    return chosen


def _trial(cfg: PlanConfig, flags: str, changes: dict, log, on_trial) -> Plan:
    """One set's plan (compiled, without the detail), logged as a line of the search."""
    p = plan(dataclasses.replace(cfg, memory="manual", **changes), detail=False)
    if on_trial is not None:
        on_trial(p)
    log(f"  {gib(p.memory['total_bytes']):>8} GiB per device, {gib(p.memory['host_bytes']):>8} GiB host: "
        f"{'fits' if p.fits else 'over'}, estimated {p.estimate['step_seconds']:.2f} s per step  {flags}")
    return p


def unrollable(cfg: PlanConfig, p: Plan, changes: dict) -> bool:
    """Whether ``auto_fit`` also tries the chosen set with the layer loop unrolled (``--scan-unroll``): one GPU
    (``transformer.py``: a speed tool for one GPU; on several, the scan keeps one layer's gathered weights at a
    time), the loop not already unrolled, ``--memory-unroll`` on, and the set holding nothing in host memory
    (``scan_unroll`` refuses ``offload_params``; the offload sets are the memory-bound ones). Measured on an H200
    (llama3.2-1b at 32K, ``save_matmuls``, same call): 1.040 -> 1.019 s, 46.6 -> 47.8 GiB
    (``experiments/results/peers_h200_20261128b.csv``); the estimate credits the fills and slice updates it removes by
    their bytes (3.3% there)."""
    return (cfg.memory_unroll and cfg.devices == 1 and not cfg.scan_unroll and p.memory["host_bytes"] == 0
            and not changes.get("offload_params"))


NEAR = 0.02  # a lead this small is inside the estimate's error (within 5.2% of each step measured on an H200)
# the fastest set is taken outright where it needs no host memory and at most this share of the device budget: XLA's
# buffer assignment, which the plan reads, was within 1% of the peaks measured on an H200 (llama3.2-1b 32K: 46.12
# GiB planned, 46.6 measured), so a quarter of the budget to spare leaves no real risk of a step that does not fit
ROOMY = 0.75


def _fastest(fitting: list) -> tuple:
    """The ``(plan, flags, changes)`` to train with, of the sets in ``fitting`` within ``NEAR`` of the lowest estimated
    step time: the fastest of those that need no host memory and at most ``ROOMY`` of the device budget; where none
    does, the one that needs no host memory and then the least device memory (ties: the faster). An estimated 1-2%
    is inside the estimate's error: worth a set that fills a third of the GPU (llama3.2-1b at 32K: 47.8 GiB of 126),
    not one near the budget, where the risk is a step that does not fit."""
    step = lambda f: f[0].estimate["step_seconds"]  # noqa: E731
    best = min(step(f) for f in fitting)
    near = [f for f in fitting if step(f) <= best * (1 + NEAR)]
    roomy = [f for f in near if f[0].memory["host_bytes"] == 0
             and f[0].memory["total_bytes"] <= ROOMY * f[0].memory["budget_bytes"]]
    if roomy:
        return min(roomy, key=lambda f: (step(f), f[0].memory["total_bytes"]))
    return min(near, key=lambda f: (f[0].memory["host_bytes"] > 0, f[0].memory["total_bytes"], step(f)))


def log_alternatives(p: Plan, log) -> None:
    log("Runners-up (--memory auto; estimated step time where they fit):")
    for r in p.alternatives:
        est = f"{r['step_seconds']:.2f} s/step" if r["step_seconds"] is not None and r["fits"] else "-"
        length = f"{r['seq_len']:,}" if r["seq_len"] else "-"
        verdict = {True: "fits", False: "over", None: ""}[r["fits"]]
        note = f"  ({r['note']})" if r["note"] else ""
        log(f"  {length:>12} tokens  {verdict:<4}  {est:>14}  {r['flags']}{note}")
