"""Record and replay of MoE expert choices (GSPO paper section 5.3), and routing diagnostics."""

from gspo_lab.routing.engine_traces import trace_from_routed_experts
from gspo_lab.routing.hooks import ReplayStats, record_routing, replay_routing
from gspo_lab.routing.replay import RoutingReplay, is_moe
from gspo_lab.routing.trace import RoutingTrace, changed_fraction

__all__ = ["ReplayStats", "RoutingReplay", "RoutingTrace", "changed_fraction", "is_moe", "record_routing", "replay_routing",
           "trace_from_routed_experts"]
