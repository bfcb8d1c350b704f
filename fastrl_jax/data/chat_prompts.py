"""General chat prompts: a templated training stream and a fixed, hand-written held-out set.

Drafters trained only on math answers see few everyday words; mixing these prompts into the
warm-up data keeps drafting useful on ordinary chat. Three families: 42 templates over 131 topics
(explanations, lists, stories, poems, letters, dialogues), 5 phrasings of 48 everyday tasks ("How do
I ...?"), and 3 of 16 short messages (notes, invitations, apologies); fewer templates left chat
acceptance far below math's (docs/measurements.md). The held-out set shares no template with the
training stream, so it measures transfer rather than memorised phrasing.
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
    "Help me understand {topic}. I am a complete beginner.",
    "What are some surprising things most people do not know about {topic}?",
    "Write a short speech about {topic}.",
    "Give me a checklist related to {topic}.",
    "Explain {topic} using an analogy.",
    "Which words should I know when talking about {topic}? Define each one.",
    "Write a diary entry by someone who spent the day thinking about {topic}.",
    "What are three myths about {topic}, and what is the truth?",
    "Plan a short lesson about {topic} for a class of teenagers.",
    "How has our understanding of {topic} changed over the last hundred years?",
    "What advice would an expert give a beginner about {topic}?",
    "Describe a typical day for someone whose job involves {topic}.",
    "How does {topic} affect the environment?",
    "Write a social media post that gets people excited about {topic}.",
    "Suggest a simple activity that teaches children about {topic}.",
    "Give a one-sentence answer and then a longer answer: what is {topic}?",
    "What safety advice matters most for {topic}?",
    "Write a short conversation between a customer and a shop assistant about {topic}.",
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
    "vitamins", "wind turbines", "the Roman Empire", "thunderstorms", "email etiquette", "bees and flowers",
    "public speaking", "meditation", "rain forests", "credit cards", "the immune system", "hiking boots",
    "origami", "lighthouses", "recycling paper", "coral reefs", "online shopping", "sunscreen",
    "the Olympic Games", "houseplants", "pizza", "the alphabet", "elephants", "first aid",
    "traffic lights", "magnets", "video games", "bread yeast", "the metric system", "job interviews",
    "podcasts", "the Eiffel Tower", "cooking rice", "sharks", "batteries", "hot air balloons",
    "kites", "cheese making", "the Great Wall of China", "spiders", "budget travel", "microwaves",
    "science fairs", "lakes", "road trips", "the post office", "sign language", "fireworks",
    "skateboarding", "glaciers", "wolves", "handwriting", "zoos", "the seasons", "owls",
    "chocolate", "farming", "mountains", "night skies", "the piano", "tornadoes", "soap",
    "teamwork", "recipes from grandparents", "ice cream", "satellites", "compost",
)
# Everyday requests, each a whole prompt (tasks, situations, short messages), phrased unlike the
# topic templates above.
_TASKS = (
    "fix a squeaky door", "keep basil alive indoors", "write a good cover letter", "clean a cast iron pan",
    "learn to juggle", "remember people's names", "plan a picnic for six people", "start running again after a break",
    "choose a good watermelon", "teach a dog to sit", "make friends in a new city", "organize a small closet",
    "save for a new bicycle", "write a short wedding toast", "fall asleep faster", "keep a journal",
    "cook rice without a rice cooker", "ask for a raise", "set up a budget spreadsheet", "get rid of fruit flies",
    "stop procrastinating on homework", "pick a first camera", "host a board game night", "make cold brew coffee",
    "prepare for a math exam", "paint a room", "care for a goldfish", "fold a paper airplane",
    "write a book report", "learn touch typing", "sharpen a kitchen knife", "grow tomatoes on a balcony",
    "change a bike tire", "write a polite complaint", "make a simple website", "train for a 5k race",
    "read more books", "speak up in meetings", "choose a laptop for school", "pack a lunch for a hike",
    "clean a computer keyboard", "plan a surprise party", "make pancakes from scratch", "keep a bathroom mirror from fogging",
    "learn the names of the stars", "calm down before a test", "write a thank-you letter to a mentor", "repot a cactus",
)
_TASK_TEMPLATES = (
    "How do I {task}?",
    "What is the easiest way to {task}?",
    "I want to {task}. What do I need, and what are the steps?",
    "My friend asked me how to {task}. What should I tell them?",
    "What mistakes should I avoid when I {task}?",
)
_MESSAGES = (
    "an apology to a neighbor for a noisy party", "an invitation to a birthday picnic", "a reminder about a team meeting",
    "a congratulations card for a new baby", "a request to reschedule a dentist appointment",
    "a welcome message for a new club member", "a get-well-soon card for a coworker", "a complaint about a late delivery",
    "a farewell message for a retiring boss", "a note asking a roommate to do the dishes",
    "a thank-you message for a birthday gift", "an announcement of a bake sale",
    "a note to a teacher explaining a missed class", "an invitation to a neighborhood cleanup",
    "a message asking a friend to return a borrowed book", "a short toast for a friend's graduation",
)
_MESSAGE_TEMPLATES = (
    "Write {message}.",
    "Draft a short, warm text message: {message}.",
    "Help me write {message}. Keep it brief and kind.",
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


_FAMILY_SHARES = (0.7, 0.22, 0.08)  # topic templates, tasks, messages


def _families() -> list[tuple[float, list[str]]]:
    prompts = ([t.format(topic=x) for t in _TEMPLATES for x in _TOPICS],
               [t.format(task=x) for t in _TASK_TEMPLATES for x in _TASKS],
               [t.format(message=x) for t in _MESSAGE_TEMPLATES for x in _MESSAGES])
    return list(zip(_FAMILY_SHARES, prompts))


def train_prompts(seed: int, count: int) -> list[str]:
    """`count` prompts of the training stream `seed` (deterministic): each family its share, every
    prompt of a family once before any repeats, then shuffled together."""
    rng = np.random.default_rng([seed, 7919])
    out: list[str] = []
    for i, (share, prompts) in enumerate(_families()):
        n = count - len(out) if i == len(_FAMILY_SHARES) - 1 else round(count * share)
        order = rng.permutation(len(prompts))
        out += [prompts[order[j % len(prompts)]] for j in range(n)]
    return [out[j] for j in rng.permutation(len(out))]


def held_out_prompts(count: int | None = None) -> list[str]:
    """The first `count` (all when None) hand-written held-out prompts."""
    if count is not None and not 0 <= count <= len(HELD_OUT):
        raise ValueError(f"there are {len(HELD_OUT)} held-out chat prompts, asked for {count}")
    return list(HELD_OUT[:count])
