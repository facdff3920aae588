"""Step-time curves for simulated replicas: a profiled `CostModel`, or a roofline for a GPU class.

A decoder forward over B tokens reads every weight once and does ~2·P FLOPs per token, so

    t(B) = t_launch + max(W / (BW · η_mem), 2 · P · B / (F · η_flop))

memory-bound (flat) at small B, compute-bound (linear in B) past the ridge
B* = W · F · η_flop / (2 · P · BW · η_mem). KV-cache reads, attention FLOPs and tile
quantisation are left out: the curve is the first-order shape the scheduler trades against.

Peak numbers (dense BF16 tensor-core FLOP/s, memory bandwidth) are from NVIDIA's datasheets:
- H100 SXM5: 989 TFLOP/s, 3.35 TB/s HBM3 (NVIDIA H100 Tensor Core GPU datasheet);
- H200 SXM: 989 TFLOP/s, 4.8 TB/s HBM3e (NVIDIA H200 Tensor Core GPU datasheet);
- A100 SXM 80 GB: 312 TFLOP/s, 2.039 TB/s HBM2e (NVIDIA A100 Tensor Core GPU datasheet);
- L40S: 362 TFLOP/s, 864 GB/s GDDR6 (NVIDIA L40S datasheet; 733 is the sparse figure).
Achieved fractions η_mem = 0.8 and η_flop = 0.6 and the 0.3 ms launch floor (CUDA graphs)
are this project's assumptions, not measurements; pass others to `roofline_cost`.

Example:
    >>> cost = roofline_cost("h100", TARGET_8B, DRAFT_DSPARK)
    >>> round(cost.verify_time(1) * 1e3, 2), round(cost.verify_time(2048) * 1e3, 1)
    (6.27, 55.5)
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.coordinator.cost_model import CostModel


@dataclass(frozen=True)
class GpuClass:
    name: str
    flops: float  # dense BF16 FLOP/s
    mem_bw: float  # bytes/s


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float  # parameters touched per token (active parameters for an MoE)
    weight_bytes: float  # bytes read per forward


GPUS: dict[str, GpuClass] = {
    "h100": GpuClass("h100", 989e12, 3.35e12),
    "h200": GpuClass("h200", 989e12, 4.8e12),
    "a100": GpuClass("a100", 312e12, 2.039e12),
    "l40s": GpuClass("l40s", 362e12, 0.864e12),
}

TARGET_8B = ModelSpec("dense-8b-bf16", 8e9, 16e9)
DRAFT_DSPARK = ModelSpec("dspark-drafter-0.5b-bf16", 0.5e9, 1e9)  # a few layers + shared head
MARKOV_RANK = 256  # the DSpark drafter's Markov head (DeepSpec's configs)
VOCAB = 151_936  # Qwen3's vocabulary, the released drafters' targets

MEM_EFFICIENCY = 0.8
FLOP_EFFICIENCY = 0.6
LAUNCH_S = 0.3e-3


def forward_time(gpu: GpuClass, model: ModelSpec, num_tokens: int, launch_s: float = LAUNCH_S,
                 mem_eff: float = MEM_EFFICIENCY, flop_eff: float = FLOP_EFFICIENCY) -> float:
    """Seconds of one forward over `num_tokens` tokens (the roofline above)."""
    memory = model.weight_bytes / (gpu.mem_bw * mem_eff)
    compute = 2.0 * model.params * num_tokens / (gpu.flops * flop_eff)
    return launch_s + max(memory, compute)


def markov_step_time(gpu: GpuClass, num_reqs: int, mem_eff: float = MEM_EFFICIENCY) -> float:
    """Seconds of one Markov-head position of a DSpark round over `num_reqs` requests (DESIGN.md
    §5: logits U_k + W2(W1[x_{k−1}]) over the vocabulary, then a draw): memory-bound, it reads W2
    (rank × vocabulary, bf16) and writes and reads back each request's fp32 logits row. No launch
    floor of its own: the loop runs inside the round's captured graph. (The paper measures the
    whole sequential loop at 0.2–1.3% of a round at batch 128.)"""
    moved = MARKOV_RANK * VOCAB * 2 + 2 * 4 * num_reqs * VOCAB
    return moved / (gpu.mem_bw * mem_eff)


def roofline_cost(gpu: str | GpuClass, target: ModelSpec = TARGET_8B,
                  drafter: ModelSpec | None = DRAFT_DSPARK, b_max: int = 8192, n_max: int = 2048,
                  block_size: int | None = None, **kwargs: float) -> CostModel:
    """A `CostModel` for a GPU class: verify of 1..b_max tokens, and a drafting round over
    1..n_max requests. `block_size` γ: a DSpark block drafter, whose round's first position is
    one forward of γ tokens per request (the block pass) and each further position one
    Markov-head step (`markov_step_time`); None: a sequential draft model, one forward of one
    token per request per position. The engine profiles its drafters the same way (a round's
    first position apart from each further one), so the simulated policies price a round as
    the simulator's clock charges it."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    verify = tuple(forward_time(g, target, b, **kwargs) for b in range(1, b_max + 1))
    draft: tuple[float, ...] = ()
    first: tuple[float, ...] = ()
    if drafter is not None and block_size is None:
        draft = tuple(forward_time(g, drafter, n, **kwargs) for n in range(1, n_max + 1))
    elif drafter is not None:
        mem_eff = kwargs.get("mem_eff", MEM_EFFICIENCY)
        draft = tuple(markov_step_time(g, n, mem_eff) for n in range(1, n_max + 1))
        first = tuple(forward_time(g, drafter, n * block_size, **kwargs) + step
                      for n, step in zip(range(1, n_max + 1), draft, strict=True))
    meta = {"gpu": g.name, "target": target.name, "drafter": drafter.name if drafter else "",
            "source": "roofline (coordinator/sim/hardware.py)"}
    return CostModel(f"roofline-{g.name}-{target.name}", verify, draft, meta, draft_first=first)


def load_curve(spec: str, drafter: ModelSpec | None = DRAFT_DSPARK,
               block_size: int | None = None) -> CostModel:
    """`spec` is a GPU class name (h100, h200, a100, l40s) or the path of a profiled JSON;
    `block_size` as in `roofline_cost` (a profile knows its drafter's rounds already)."""
    if spec.lower() in GPUS:
        return roofline_cost(spec.lower(), drafter=drafter, block_size=block_size)
    return CostModel.load(spec)
