from moetrain.models.moe.dispatcher import Dispatcher, DispatchResult, LocalDispatcher, expert_capacity
from moetrain.models.moe.experts import GroupedExperts
from moetrain.models.moe.layer import MoEAux, MoELayer
from moetrain.models.moe.router import RouterOutput, TopKRouter

__all__ = ["DispatchResult", "Dispatcher", "GroupedExperts", "LocalDispatcher", "MoEAux", "MoELayer",
           "RouterOutput", "TopKRouter", "expert_capacity"]
