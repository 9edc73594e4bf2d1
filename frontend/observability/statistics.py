"""The statistics extension (docs/triton-compat.md §1.11): the scheduler's counters as Triton's JSON and as
gRPC ``ModelStatisticsResponse`` (the query itself is ``FrontendService.statistics``)."""
from __future__ import annotations

from tritonclient.grpc import service_pb2 as pb

from shmserve.ipc.messages.to_frontend import Duration, ModelStatistics

STAT_FIELDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
               "cache_hit", "cache_miss")
RESPONSE_FIELDS = ("compute_infer", "compute_output", "success", "fail", "empty_response",
                   "cancel")


def _d(d: Duration) -> dict:
    return {"count": d.count, "ns": d.ns}


def to_json(models: list[ModelStatistics]) -> dict:
    out = []
    for m in models:
        out.append({
            "name": m.name,
            "version": str(m.version),
            "last_inference": m.last_inference,
            "inference_count": m.inference_count,
            "execution_count": m.execution_count,
            "inference_stats": {f: _d(getattr(m, f)) for f in STAT_FIELDS},
            "response_stats": {k: {f: _d(getattr(r, f)) for f in RESPONSE_FIELDS}
                               for k, r in m.response_stats.items()},
            "batch_stats": [{"batch_size": b.batch_size, "compute_input": _d(b.compute_input),
                             "compute_infer": _d(b.compute_infer),
                             "compute_output": _d(b.compute_output)} for b in m.batch_stats],
            "memory_usage": [],
        })
    return {"model_stats": out}


def _set(target, d: Duration) -> None:
    target.count = d.count
    target.ns = d.ns


def to_proto(models: list[ModelStatistics]) -> pb.ModelStatisticsResponse:
    resp = pb.ModelStatisticsResponse()
    for m in models:
        s = resp.model_stats.add(name=m.name, version=str(m.version),
                                 last_inference=m.last_inference,
                                 inference_count=m.inference_count,
                                 execution_count=m.execution_count)
        for f in STAT_FIELDS:
            _set(getattr(s.inference_stats, f), getattr(m, f))
        for k, r in m.response_stats.items():
            pb_r = s.response_stats[k]
            for f in RESPONSE_FIELDS:
                _set(getattr(pb_r, f), getattr(r, f))
        for b in m.batch_stats:
            pb_b = s.batch_stats.add(batch_size=b.batch_size)
            _set(pb_b.compute_input, b.compute_input)
            _set(pb_b.compute_infer, b.compute_infer)
            _set(pb_b.compute_output, b.compute_output)
    return resp
