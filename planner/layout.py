"""Where a job's GPUs sit and what moving data between them costs: the parallel layout of a spec.

Why a module: the cost model needs, for each kind of communication (tensor-parallel collectives,
context-parallel ring, expert all-to-all, pipeline p2p, data-parallel gradient reduction), which link
it crosses and how long it takes; that follows from the rank order and the cluster, not from any
layer formula.

Rank order (Megatron-LM's default, "tp-cp-dp-pp"): rank = tp_rank + tp·(cp_rank + cp·(dp_rank +
dp·pp_rank)), nodes hold `gpus_per_node` consecutive ranks. A group whose members lie within
`span` consecutive ranks stays inside a node when span <= gpus_per_node (tp: span tp; cp: tp·cp;
data parallel with cp: tp·cp·dp); otherwise it crosses InfiniBand, which then bounds it (a ring
over several nodes runs at the NIC rate: each GPU has its own NIC on a DGX node). Expert layers
fold etp x ep x edp onto the tp·cp·dp GPUs of a stage, etp fastest: an ep group spans ep·etp ranks.

Times (bandwidth B per GPU per direction, link efficiency e, latency L):
* all-gather / reduce-scatter of a tensor of V bytes over n ranks (ring): (n-1)/n · V / (e·B) +
  (n-1)·L; all-reduce twice that (NCCL's bus-bandwidth model);
* all-to-all where each GPU sends V bytes spread evenly over n ranks: the share for other nodes
  crosses the NIC, the share for the same node NVLink, both at once: max of the two, + L;
* p2p of V bytes: V / (e·B) + L on the slowest link the pipeline crosses.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Cluster, Spec


@dataclass(frozen=True)
class Layout:
    """The degrees of parallelism of a spec and the cluster they run on."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    etp: int
    sp: bool
    cluster: Cluster

    @classmethod
    def of(cls, spec: Spec) -> Layout:
        par, pp = spec.parallel_or_default, spec.training.devices
        cluster = spec.cluster_or_default
        if cluster is None:  # custom hardware and no cluster: every link is the hardware's p2p link
            hw = spec.hardware
            cluster = Cluster(name="hardware link", gpus_per_node=max(1, par.tp * par.cp * pp * par.dp_of(pp)),
                              nvlink_gbps=hw.link_gbps, nvlink_latency_us=hw.link_latency_us,
                              ib_gbps=hw.link_gbps, ib_latency_us=hw.link_latency_us, bus_efficiency=1.0)
        return cls(tp=par.tp, cp=par.cp, pp=pp, dp=par.dp_of(pp), ep=par.ep, etp=par.expert_tp,
                   sp=par.sequence_parallel, cluster=cluster)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def stage_gpus(self) -> int:
        """GPUs one pipeline stage spans: tp x cp x dp."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data parallel degree: the stage's GPUs over ep x etp."""
        return self.stage_gpus // (self.ep * self.etp)

    def _link(self, span: int) -> tuple[float, float]:
        """(bytes per ms, latency ms) of a group spread over `span` consecutive ranks."""
        c = self.cluster
        gbps, lat = (c.nvlink_gbps, c.nvlink_latency_us) if span <= c.gpus_per_node else (c.ib_gbps, c.ib_latency_us)
        return gbps * c.bus_efficiency * 1e6, lat / 1e3

    def ring_ms(self, nbytes: float, n: int, span: int) -> float:
        """All-gather or reduce-scatter of an `nbytes` tensor over `n` ranks within `span` ranks."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        rate, lat = self._link(span)
        return (n - 1) / n * nbytes / rate + (n - 1) * lat

    def tp_collective_ms(self, nbytes: float) -> float:
        return self.ring_ms(nbytes, self.tp, self.tp)

    def cp_ring_ms(self, nbytes: float) -> float:
        """One step of the context-parallel ring: each GPU passes `nbytes` to its neighbour."""
        if self.cp <= 1 or nbytes <= 0:
            return 0.0
        rate, lat = self._link(self.tp * self.cp)
        return nbytes / rate + lat

    def all_to_all_ms(self, nbytes: float) -> float:
        """Expert all-to-all: each GPU sends `nbytes` spread over the ep ranks of its group."""
        if self.ep <= 1 or nbytes <= 0:
            return 0.0
        c = self.cluster
        local = max(1, min(self.ep, c.gpus_per_node // self.etp))  # group members on this node
        intra = (local - 1) / self.ep * nbytes
        inter = (self.ep - local) / self.ep * nbytes
        nv, nv_lat = self._link(1)
        ib, ib_lat = self._link(c.gpus_per_node + 1)
        return max(intra / nv, inter / ib) + (ib_lat if inter else nv_lat)

    @property
    def p2p_crosses_nodes(self) -> bool:
        """A pipeline hop joins ranks tp·cp·dp apart; does any hop leave its node?"""
        stride, node = self.stage_gpus, self.cluster.gpus_per_node
        return any(k * stride // node != (k + 1) * stride // node for k in range(self.pp - 1))

    def p2p_ms(self, nbytes: float) -> float:
        rate, lat = self._link(self.cluster.gpus_per_node + 1 if self.p2p_crosses_nodes else 1)
        return nbytes / rate + lat

    def grad_reduce_ms(self, dense_bytes: float, expert_bytes: float, all_reduce: bool) -> float:
        """Data-parallel reduction of a stage's gradients: dense ones over dp x cp ranks, expert
        ones over edp; a reduce-scatter (sharded optimizer) or an all-reduce (replicated)."""
        span = self.stage_gpus
        t = self.ring_ms(dense_bytes, self.dp * self.cp, span) + self.ring_ms(expert_bytes, self.edp, span)
        return 2 * t if all_reduce else t

    def param_gather_ms(self, dense_bytes: float, expert_bytes: float) -> float:
        """The distributed optimizer's all-gather of updated 16-bit weights."""
        span = self.stage_gpus
        return self.ring_ms(dense_bytes, self.dp * self.cp, span) + self.ring_ms(expert_bytes, self.edp, span)
