"""A multi-turn verifiers (v1) environment for the verifiers tests: its own `Env.run` plays the user turn by
turn through `agents.player.interaction(task)`, as verifiers' TextArena environment does, and records a
reward of its own besides the task's rubric."""

import verifiers.v1 as vf

TURNS = 3
BONUS, BONUS_WEIGHT = 0.5, 0.2


def length_score(reply: str) -> float:
    return float(len(reply) % 2)


class GuessData(vf.TaskData):
    target: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def length(self, trace) -> float:
        return length_score(trace.last_reply)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for t in range(12):
            yield GuessTask(GuessData(prompt=f"Guess my number ({t}).", target=t), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as exchange:
            segment = await exchange.turn()
            for _ in range(TURNS - 1):
                if segment.terminated:
                    break
                segment = await exchange.turn("Wrong. Again.")
        exchange.trace.record_reward("bonus", BONUS, BONUS_WEIGHT)


__all__ = ["GuessEnv", "GuessTaskset"]
