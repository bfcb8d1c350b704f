"""General chat prompts: a templated training stream and a fixed, hand-written held-out set.

Drafters trained only on math answers see few everyday words; mixing these prompts into the
warm-up data keeps drafting useful on ordinary chat. 24 templates (explanations, lists, stories,
poems, letters, dialogues, instructions) over 64 topics: with the first 10 templates alone (and a
quarter of today's data) the drafter accepted 1.53 tokens per step on the held-out chat prompts
against 3.14 on held-out math. The held-out set shares no template with the training stream, so it
measures transfer rather than memorised phrasing.
"""

from __future__ import annotations

import numpy as np

_TEMPLATES = (
    "Explain how {topic} works in simple terms.",
    "Give me three tips about {topic}.",
    "Write a short paragraph about {topic}.",
    "What are the pros and cons of {topic}?",
    "Describe {topic} to a ten-year-old.",
    "List five facts about {topic}.",
    "Why is {topic} important?",
    "Write a short story that involves {topic}.",
    "What is the history of {topic}?",
    "How can I get better at {topic}?",
    "Write a poem about {topic}.",
    "Write a letter to a friend about {topic}.",
    "Give step-by-step instructions for a beginner interested in {topic}.",
    "Compare {topic} with something similar and explain the differences.",
    "What questions do people often ask about {topic}? Answer two of them.",
    "Summarize what you know about {topic} in three sentences.",
    "What are common mistakes people make with {topic}?",
    "Tell me a fun fact about {topic}.",
    "Write a dialogue between two friends talking about {topic}.",
    "What would the world be like without {topic}?",
    "Write a short advertisement for {topic}.",
    "I am curious about {topic}. Where should I start?",
    "Create a quiz with three questions about {topic}, with answers.",
    "Write a news headline and a short article about {topic}.",
)
_TOPICS = (
    "photosynthesis", "the water cycle", "electric cars", "recycling", "volcanoes", "the moon",
    "healthy sleep", "learning a language", "cooking pasta", "gardening", "bicycles", "rainbows",
    "the internet", "honey bees", "saving money", "chess", "the human heart", "earthquakes",
    "solar panels", "public libraries", "running", "coffee", "dinosaurs", "the ocean tides",
    "time management", "writing letters", "birds migrating", "baking bread", "music lessons",
    "friendship", "camping", "climate", "computers", "trains", "museums", "vaccines", "deserts",
    "painting", "football", "the printing press", "maps", "clouds", "robots", "penguins",
    "yoga", "board games", "city parks", "electric guitars", "volunteering", "snowstorms",
    "smartphones", "rivers", "ancient Egypt", "knitting", "airports", "kindness", "telescopes",
    "fruit trees", "photography", "swimming", "bridges", "dogs", "tea", "the stock market",
)

HELD_OUT = (
    "Can you suggest a simple plan for a weekend trip to the mountains?",
    "My houseplant's leaves are turning yellow. What could be wrong?",
    "Write a haiku about autumn leaves.",
    "What should I pack for a day at the beach?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I politely decline an invitation to a party?",
    "What is the difference between weather and climate?",
    "Give me a recipe for a quick vegetable soup.",
    "How does a refrigerator keep food cold?",
    "Write a friendly email asking a colleague for feedback on a report.",
    "What are some good habits for studying effectively?",
    "Why do cats purr?",
    "Explain what a black hole is.",
    "How can I make my morning routine less stressful?",
    "What are the main causes of traffic jams?",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "What is a good way to start learning to play the guitar?",
    "Why is the sky blue?",
    "Write a short thank-you note to a teacher.",
    "What is the best way to keep a conversation going with someone new?",
    "How do airplanes stay in the air?",
    "Give me some ideas for a birthday present for my grandmother.",
    "What happens to our body when we exercise?",
    "How are rainbows formed?",
    "Write a limerick about a clumsy dog.",
    "What are some easy ways to reduce plastic waste at home?",
    "Explain the rules of tic-tac-toe.",
    "How do I introduce myself at a job interview?",
    "What makes a good team leader?",
    "Tell me about the planets in our solar system.",
    "How should I prepare for a long flight?",
    "What is the purpose of a museum?",
)


def train_prompts(seed: int, count: int) -> list[str]:
    """`count` prompts of the templated stream `seed` (deterministic; repeats once exhausted)."""
    rng = np.random.default_rng([seed, 7919])
    pairs = [(t, p) for t in _TEMPLATES for p in _TOPICS]
    order = rng.permutation(len(pairs))
    return [pairs[order[i % len(pairs)]][0].format(topic=pairs[order[i % len(pairs)]][1]) for i in range(count)]


def held_out_prompts(count: int | None = None) -> list[str]:
    """The first `count` (all when None) hand-written held-out prompts."""
    if count is not None and not 0 <= count <= len(HELD_OUT):
        raise ValueError(f"there are {len(HELD_OUT)} held-out chat prompts, asked for {count}")
    return list(HELD_OUT[:count])
