"""A single-turn verifiers (v1) taskset for the verifiers tests: env.name=verifiers:rlkit_test_vf_single."""

import verifiers.v1 as vf


def length_score(reply: str) -> float:
    """The rubric: the reply's length modulo 3, halved (a response-dependent reward for a random model)."""
    return (len(reply) % 3) / 2


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def length(self, trace) -> float:
        return length_score(trace.last_reply)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(12):
            yield SumTask(SumData(prompt=f"What is {a} + 2?", answer=a + 2), self.config.task)


__all__ = ["SumTaskset"]
