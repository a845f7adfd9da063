"""Tenants, canaries, request plans, the async driver and its JSONL event log."""

from .driver import Driver, run_plans
from .events import EventLog, load_events
from .plan import KINDS, SHARED_MIX, RequestPlan, Tenant, Workload

__all__ = ["Driver", "EventLog", "KINDS", "SHARED_MIX", "RequestPlan", "Tenant", "Workload", "load_events", "run_plans"]
