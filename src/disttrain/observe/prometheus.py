"""Prometheus: every rank serves its own metrics over HTTP (port + local rank).

Names follow Prometheus conventions: `disttrain_` prefix, base units (`_seconds`, `_bytes`),
`_total` for counters, and a `rank` label so one dashboard shows every rank of the job.
"""

from __future__ import annotations

from disttrain.observe.sinks import Sink


class PrometheusSink(Sink):
    """Serves this rank's metrics over HTTP; `step_seconds` is observed every step, the rest at log steps."""

    def __init__(self, port: int, host: str, rank: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        labels = {"rank": str(rank)}
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

        def gauge(name, doc):
            return Gauge(name, doc, ["rank"], registry=self.registry).labels(**labels)

        self.tokens_per_second = gauge("disttrain_tokens_per_second", "Global training throughput in tokens/s")
        self.loss = gauge("disttrain_loss", "Mean token cross-entropy of the last logged global batch")
        self.learning_rate = gauge("disttrain_learning_rate", "Learning rate of the last logged step")
        self.grad_norm = gauge("disttrain_grad_norm", "Global gradient norm before clipping")
        self.memory_peak = gauge("disttrain_memory_peak_bytes", "Peak memory, max over ranks")
        self.step = gauge("disttrain_step", "Last completed optimizer step")
        self.mfu = gauge("disttrain_mfu_ratio", "Model FLOPs utilisation (0-1), when peak FLOP/s is known")
        self.phase_seconds = Gauge("disttrain_step_phase_seconds", "Mean seconds per step of each phase on this rank "
                                   "(data, forward, backward, comm_exposed, optimizer)", ["rank", "phase"],
                                   registry=self.registry)
        self.comm_seconds = Gauge("disttrain_collective_seconds", "Seconds per step in each collective kind on this "
                                  "rank (last profiled step)", ["rank", "collective"], registry=self.registry)
        self.memory = Gauge("disttrain_memory_bytes", "This rank's memory: allocated/reserved/peak (CUDA) or rss (CPU)",
                            ["rank", "kind"], registry=self.registry)
        self.rank_compute = gauge("disttrain_rank_compute_seconds", "Slowest rank's per-step compute time")
        self.slowest_rank = gauge("disttrain_slowest_rank", "Rank id with the longest compute time at the last log")
        self.loss_scale = gauge("disttrain_loss_scale", "fp16 dynamic loss scale")
        self.overflows = gauge("disttrain_fp16_overflow_steps", "fp16 steps skipped for inf/NaN gradients so far")
        self.pp_bubble = gauge("disttrain_pipeline_bubble_ratio", "Measured idle share of the pipeline schedule")
        self.balance_share = Gauge("disttrain_balance_share_microbatches", "Micro-batches of the global batch each "
                                   "data-parallel rank computes (uneven shares)", ["rank", "dp_rank"],
                                   registry=self.registry)
        self.expert_tokens = Gauge("disttrain_moe_expert_tokens", "Tokens each expert of an MoE layer was chosen for "
                                   "in the last logged global batch", ["rank", "layer", "expert"],
                                   registry=self.registry)
        self.moe_layer = Gauge("disttrain_moe_routing", "Per MoE layer at the last log: load_imbalance (max/mean "
                               "tokens per expert), dropped_tokens, aux_loss, router_entropy",
                               ["rank", "layer", "kind"], registry=self.registry)
        self.rank = str(rank)
        self.steps = Counter("disttrain_steps", "Optimizer steps completed by this process", ["rank"],
                             registry=self.registry).labels(**labels)
        self.step_seconds = Histogram("disttrain_step_seconds", "Wall time of one optimizer step on this rank",
                                      ["rank"], buckets=buckets, registry=self.registry).labels(**labels)
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def observe_step(self, seconds: float) -> None:
        self.steps.inc()
        self.step_seconds.observe(seconds)

    def log_step(self, record: dict) -> None:
        self.step.set(record["step"])
        self.tokens_per_second.set(record["tokens_per_sec"])
        self.loss.set(record["loss"])
        self.learning_rate.set(record["lr"])
        self.grad_norm.set(record["grad_norm"])
        self.memory_peak.set(record["mem_peak_bytes"])
        if "mfu" in record:
            self.mfu.set(record["mfu"])
        for key, value in record.items():
            if key.startswith("time_") and key.endswith("_s"):
                self.phase_seconds.labels(rank=self.rank, phase=key[5:-2]).set(value)
            elif key.startswith("comm_") and key.endswith("_s") and key != "comm_time_s":
                self.comm_seconds.labels(rank=self.rank, collective=key[5:-2]).set(value)
            elif key in ("mem_allocated_bytes", "mem_reserved_bytes", "mem_rank_peak_bytes", "mem_rss_bytes"):
                self.memory.labels(rank=self.rank, kind=key[4:-6]).set(value)
        optional = {"rank_compute_max_s": self.rank_compute, "slowest_rank": self.slowest_rank,
                    "loss_scale": self.loss_scale, "fp16_overflows_total": self.overflows, "pp_bubble": self.pp_bubble}
        for layer, counts in record.get("moe_tokens_per_expert", {}).items():
            for expert, count in enumerate(counts):
                self.expert_tokens.labels(rank=self.rank, layer=layer, expert=str(expert)).set(count)
        for key, value in record.items():
            parts = key.split("_", 2)
            if key.startswith("moe_") and len(parts) == 3 and parts[1].isdigit():
                self.moe_layer.labels(rank=self.rank, layer=parts[1], kind=parts[2]).set(value)
        for dp_rank, share in enumerate(record.get("balance_shares", ())):
            self.balance_share.labels(rank=self.rank, dp_rank=str(dp_rank)).set(share)
        for key, metric in optional.items():
            if key in record:
                metric.set(record[key])

    def close(self) -> None:
        self.server.shutdown()
