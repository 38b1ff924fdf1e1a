"""Multi-turn environments and tools: the interface, the registry, the bundled environments, the tool-call
parser and the Python sandbox. rollout/multiturn.py drives them (`rollout.env=<name>`)."""
from hybridrl.envs import bundled  # noqa: F401  (registers the bundled environments)
from hybridrl.envs.base import ENVIRONMENTS, Environment, EnvironmentStepError, StepResult, env_class, make_env, register_env
from hybridrl.envs.sandbox import (SANDBOXES, Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable, register_sandbox,
                                    resolve_sandbox, run_python, set_default_sandbox)
from hybridrl.envs.tools import Tool, ToolCall, ToolCallError, ToolRegistry, parse_tool_calls, python_tool

__all__ = ["ENVIRONMENTS", "Environment", "EnvironmentStepError", "StepResult", "env_class", "make_env", "register_env", "SandboxResult",
           "run_python", "SANDBOXES", "Sandbox", "SandboxLimits", "SandboxUnavailable", "register_sandbox", "resolve_sandbox",
           "set_default_sandbox", "Tool", "ToolCall", "ToolCallError", "ToolRegistry", "parse_tool_calls", "python_tool"]
