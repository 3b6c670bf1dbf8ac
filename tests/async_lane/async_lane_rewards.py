"""The async lane's reward function, in a module of its own: TRL's rollout worker scores completions in a spawned
child process, which unpickles the function by importing this module, so it imports nothing (the child starts
faster) and the function is module-level (picklable)."""


def letter_reward(completions, **kwargs):
    """Share of characters in 'a'..'m' in each completion's last message: a smooth reward, so a group's std is rarely
    0. Completions arrive as message lists (the async worker is conversational)."""
    texts = [completion[-1]["content"] for completion in completions]
    return [sum("a" <= ch <= "m" for ch in text) / max(len(text), 1) for text in texts]
