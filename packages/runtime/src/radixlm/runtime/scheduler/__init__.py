"""The engine's scheduler (torch-free): requests, queue policies, budgets, prefix reuse, retraction."""

from radixlm.runtime.scheduler.batch import ScheduledBatch, SeqUpdate, StepEntry
from radixlm.runtime.scheduler.policy import (
    POLICIES,
    Policy,
    dfs_weight,
    fcfs,
    longest_prefix_match,
)
from radixlm.runtime.scheduler.request import Req, ReqStatus, Stopper
from radixlm.runtime.scheduler.scheduler import Drafter, RowPool, Scheduler, SlotPool

__all__ = [
    "POLICIES",
    "Drafter",
    "Policy",
    "Req",
    "ReqStatus",
    "RowPool",
    "ScheduledBatch",
    "Scheduler",
    "SeqUpdate",
    "SlotPool",
    "StepEntry",
    "Stopper",
    "dfs_weight",
    "fcfs",
    "longest_prefix_match",
]
