"""Tenants, canaries, request plans, the async driver and its JSONL event log."""

from .driver import Driver, run_plans
from .events import EventLog, load_events
from .plan import KINDS, RequestPlan, Tenant, Workload

__all__ = ["Driver", "EventLog", "KINDS", "RequestPlan", "Tenant", "Workload", "load_events", "run_plans"]
