"""Shared by the agentx.openai tests: a tool, a schema, questions, the assistant message."""

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    },
}

GREEDY = {"model": "agentx", "temperature": 0}

# a request that runs to its max_tokens (greedy): a test that aborts it sees it still running
LONG = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]

CHAT_QUESTIONS = [
    "Name a color.",
    "Another one.",
    "Name an animal.",
    "Name a fruit.",
    "Name a city.",
    "Name a number.",
    "Name a tool.",
    "Name a planet.",
    "Name a song.",
    "Name a river.",
    "Name a sport.",
    "Name a tree.",
]


def reply_message(completion, index=0):
    """The assistant message as a caller appends it to its history."""
    return completion.choices[index].message.model_dump(exclude_none=True)
