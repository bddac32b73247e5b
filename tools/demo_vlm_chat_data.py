"""Text-only chat prompts for the demo VLM's training: the language model's LoRA learns to answer about
images, and these prompts, answered by SmolLM2-135M-Instruct itself (LoRA off), teach it to keep every other
answer as it was (self-distillation).

``general_prompts(seed)`` returns a fixed, shuffled list of a few hundred everyday questions and requests
built from templates and fillers. ``HELD_OUT_QUESTIONS``, the ten the tests and the evaluation ask, are never
among them: they measure whether the model's text answers held, on prompts it never saw, and so do the
``KNOWLEDGE_QUESTIONS``, scored by the words a right answer contains (whether the answers got worse).
"""

from __future__ import annotations

import random

HELD_OUT_QUESTIONS = [
    "What is the capital of France?", "How many days are there in a week?", "What is 2 + 3?",
    "Name three colours.", "Who wrote Romeo and Juliet?", "What is the largest planet in the solar system?",
    "Translate 'thank you' into French.", "Give me a synonym for happy.", "What do bees make?",
    "Write a haiku about the sea.",
]  # fmt: skip
# General-knowledge questions with the words a right answer contains (any one, as a whole word, any case):
# the "not worse" check of a LoRA'd model's text answers, SmolLM2 alone against the demo model. Never in
# training, and none of them a filled-in _TEMPLATES phrasing.
KNOWLEDGE_QUESTIONS = [
    ("What is the boiling point of water in degrees Celsius?", ("100",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the chemical symbol for gold?", ("au",)),
    ("Who painted the Mona Lisa?", ("leonardo", "vinci")),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("How many continents are there on Earth?", ("seven", "7")),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("Which gas do plants absorb from the air?", ("carbon dioxide", "co2")),
    ("What is the square root of 81?", ("nine", "9")),
    ("In which country are the pyramids of Giza?", ("egypt",)),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("Who developed the theory of relativity?", ("einstein",)),
    ("What is the currency of Japan?", ("yen",)),
    ("How many hours are there in a day?", ("24", "twenty-four", "twenty four")),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
    ("What colour is the sky on a clear day?", ("blue",)),
    ("How many minutes are in an hour?", ("60", "sixty")),
    ("How many days are there in a leap year?", ("366",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is the closest star to the Earth?", ("sun",)),
    ("How many sides does a triangle have?", ("three", "3")),
    ("What is the capital city of the United Kingdom?", ("london",)),
    ("Who wrote the play Hamlet?", ("shakespeare",)),
    ("What do caterpillars turn into?", ("butterfly", "butterflies", "moth", "moths")),
    ("Which organ pumps blood through the body?", ("heart",)),
    ("What is the largest mammal?", ("whale",)),
    ("How many months are there in a year?", ("twelve", "12")),
    ("What is the main gas in the air we breathe?", ("nitrogen",)),
    ("What is 10 divided by 2?", ("five", "5")),
    ("Which season comes after winter?", ("spring",)),
]  # fmt: skip
_FILLERS = {
    "country": ["Italy", "Spain", "Germany", "Japan", "Canada", "Egypt", "Brazil", "Kenya", "Norway", "India",
                "Mexico", "Greece", "Peru", "Australia", "Portugal", "China"],
    "animal": ["a cat", "a dog", "an elephant", "a dolphin", "an owl", "a penguin", "a horse", "a frog", "a bee",
               "a shark", "a lion", "a rabbit"],
    "topic": ["the moon", "rain", "friendship", "autumn", "a mountain", "the city at night", "coffee", "a river",
              "winter", "the stars", "a garden", "the ocean"],
    "word": ["hello", "good morning", "water", "cat", "book", "friend", "house", "bread", "apple", "goodbye"],
    "language": ["Spanish", "German", "Italian", "French"],
    "thing": ["photosynthesis", "gravity", "a rainbow", "the internet", "a volcano", "electricity", "democracy",
              "a black hole", "inflation", "a vaccine", "recycling", "an eclipse", "evaporation", "a computer"],
    "adjective": ["big", "fast", "smart", "cold", "sad", "bright", "quiet", "old", "easy", "angry"],
    "person": ["Albert Einstein", "Marie Curie", "Isaac Newton", "Leonardo da Vinci", "Ada Lovelace",
               "William Shakespeare", "Charles Darwin", "Nelson Mandela", "Mozart", "Galileo"],
    "activity": ["learn to cook", "sleep better", "start running", "save money", "learn a language",
                 "stay focused", "make friends", "grow tomatoes", "write a story", "reduce stress"],
    "category": ["fruits", "vegetables", "planets", "musical instruments", "sports", "birds", "flowers",
                 "programming languages", "rivers", "breakfast foods"],
    "greeting": ["Hello!", "Hi there.", "Good morning!", "Hey, how are you?", "Thanks for your help!",
                 "Who are you?", "What can you do?", "Tell me a joke.", "I feel tired today.", "Can you help me?"],
}  # fmt: skip
_TEMPLATES = [
    "What is the capital of {country}?",
    "Which language is spoken in {country}?",
    "Tell me about {country}.",
    "Describe {animal}.",
    "What does {animal} eat?",
    "Where does {animal} live?",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write one sentence about {topic}.",
    "How do you say '{word}' in {language}?",
    "Translate '{word}' into {language}.",
    "Explain {thing} in simple terms.",
    "What is {thing}?",
    "Give me a synonym for {adjective}.",
    "What is the opposite of {adjective}?",
    "Who was {person}?",
    "What is {person} famous for?",
    "How can I {activity}?",
    "Give me three tips to {activity}.",
    "Name three {category}.",
    "List some {category}.",
    "What is {a} + {b}?",
    "What is {a} times {b}?",
    "Is {n} an even number?",
    "{greeting}",
]


def general_prompts(seed: int = 0) -> list[str]:
    """Every template with every filler (numbers drawn), deduplicated and shuffled with `seed`."""
    rng = random.Random(seed)
    prompts: set[str] = set()
    for template in _TEMPLATES:
        keys = [k for k in _FILLERS if "{" + k + "}" in template]
        if not keys:  # arithmetic: a dozen random operand pairs
            for _ in range(12):
                a, b, n = rng.randint(2, 20), rng.randint(2, 12), rng.randint(1, 99)
                prompts.add(template.format(a=a, b=b, n=n))
            continue
        for value in _FILLERS[keys[0]]:
            values = {keys[0]: value} | {k: rng.choice(_FILLERS[k]) for k in keys[1:]}
            prompts.add(template.format(**values))
    ordered = sorted(prompts - set(HELD_OUT_QUESTIONS))
    rng.shuffle(ordered)
    return ordered
