"""A test agent written against the OpenAI SDK that always makes two calls in one
conversation (the second after a user turn it writes itself), so training exercises a
session's continuation path whatever the random test policy says."""

from openai import AsyncOpenAI

from asyncrl.tasks.countdown import countdown_reward

TOOLS = [{"type": "function", "function": {"name": "check", "parameters": {"type": "object", "properties": {}}}}]


async def run(task, base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "check again"})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return countdown_reward(task, second.choices[0].message.content or "")
