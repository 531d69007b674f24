"""A verifiers (v1) taskset with a toolset, for the verifiers tool test."""

import verifiers.v1 as vf


class AddTools(vf.Toolset):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddTools(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == str(task.answer))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(4):
            yield SumTask(SumData(prompt=f"What is {a} + 2?", answer=a + 2), self.config.task)


__all__ = ["SumTaskset"]
