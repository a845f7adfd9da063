"""Tenants, canaries, request plans, the async driver and its JSONL event log."""

from .driver import Driver, run_plans
from .events import EventLog, load_events
from .plan import REQUEST_KINDS, SHARED_MIX, RequestPlan, Tenant, Workload, plans_digest
from .seed import Seeds

__all__ = ["Driver", "EventLog", "REQUEST_KINDS", "SHARED_MIX", "RequestPlan", "Tenant", "Seeds", "Workload", "load_events", "plans_digest",
           "run_plans"]
