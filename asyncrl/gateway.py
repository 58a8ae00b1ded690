"""Deprecated path of :mod:`asyncrl.rollout.gateway` (moved with the rollout side).
Imports it and the modules it had then, warning."""

from asyncrl import moved
from asyncrl.rollout import gateway
from asyncrl.rollout.gateway import access, openai_api, prompt_size, server, session, tool_calls

moved.alias(__name__, gateway, access, openai_api, prompt_size, server, session, tool_calls)
