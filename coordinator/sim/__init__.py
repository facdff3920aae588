"""Fleet-scale simulation of the speculative-decoding service (issue 8; docs/scale.md).

Modules, each one concept:
- `hardware`: step-time curves (a profiled `CostModel`, or a roofline for a GPU class);
- `workload`: arrival processes and prompt/output lengths;
- `acceptance`: per-step acceptance, drawn from a per-position model or replayed from a trace;
- `lane`: one batch loop driven by the engine's own policies (`make_policy`), plus `oracle`;
- `fleet`: the discrete-event loop over replicas, their GPUs and a shared draft pool;
- `report`: throughput, latency percentiles, load curves (JSON and PNG);
- `cli`: `dspark simulate`;
- `scenarios`: the set-up sweeps of docs/scale.md (disaggregated drafting, the oracle gap).
"""
