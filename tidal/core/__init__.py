"""tidal's core: requests, the paged KV cache and the scheduler. Pure Python: no torch,
no asyncio, no sockets, no environment variables; deterministic for the same inputs."""

from tidal.core.block_pool import Block, BlockPool
from tidal.core.budget import Admission, StepBudget, StepPlan
from tidal.core.config import CacheConfig, SchedulerConfig
from tidal.core.invariants import InvariantError, SchedulerStats
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.outputs import (MASKED_LOGPROB, ModelOutput, NewRequest, PromptLogprob,
                                RequestOutput, ScheduledRequest, SchedulerOutput, TokenLogprob)
from tidal.core.policies import POLICIES, Policy
from tidal.core.ratio import NewTokenRatio
from tidal.core.request import LOGPROBS_MODES, Request, RequestStatus, SamplingParams
from tidal.core.roles import ROLES, Role
from tidal.core.scheduler import Scheduler
from tidal.core.step_time import (ERROR_QUANTILES, STEP_TIME_TERMS, LearnedStepTime, LinearStepTime,
                                   PredictionLog, StepShape, StepTimeModel)

FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")

__all__ = [
    "Admission", "Block", "BlockPool", "CacheConfig", "FINISH_REASONS", "InvariantError",
    "KVCacheManager", "LOGPROBS_MODES", "MASKED_LOGPROB", "ModelOutput", "NewRequest",
    "NewTokenRatio", "POLICIES", "Policy",
    "PromptLogprob", "ROLES", "Request", "RequestOutput", "RequestStatus", "Role",
    "SamplingParams", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "SchedulerStats", "StepBudget", "StepPlan", "LearnedStepTime", "LinearStepTime",
    "ERROR_QUANTILES", "PredictionLog", "STEP_TIME_TERMS", "StepShape",
    "StepTimeModel", "TokenLogprob",
]
