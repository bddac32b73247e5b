"""Text-only chat prompts for the demo VLM's training: the language model's LoRA learns to answer about
images, and these prompts, answered by SmolLM2-135M-Instruct itself (LoRA off), teach it to keep every other
answer as it was (self-distillation).

``general_prompts(seed)`` returns a fixed, shuffled list of a few hundred everyday questions and requests
built from templates and fillers, and the ``QUIZ_QUESTIONS``, of the knowledge check's kind on other facts (since
round 12: without them the reading LoRA drifted from SmolLM2's quiz answers). ``HELD_OUT_QUESTIONS``, the ten the
tests and the evaluation ask, are never among them: they measure whether the model's text answers held, on
prompts it never saw, and so do the ``KNOWLEDGE_QUESTIONS``, scored by the words a right answer contains
(whether the answers got worse).
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
# Questions of the knowledge check's kind (one fact, asked the way a quiz asks it) on other facts: the
# distillation keeps SmolLM2's answers to such questions, which the reading LoRA otherwise drifts from. No
# question shares its fact with a KNOWLEDGE_QUESTIONS one or is one of those asked of another number,
# unit or season.
QUIZ_QUESTIONS = [
    "Who painted The Starry Night?", "Who painted The Scream?", "Who painted Guernica?",
    "Who painted The Night Watch?", "Who painted Girl with a Pearl Earring?", "Who painted The Birth of Venus?",
    "Who painted Water Lilies?", "Who sculpted David?", "Who composed the Four Seasons?",
    "Who composed the Moonlight Sonata?", "Who wrote Pride and Prejudice?", "Who wrote Don Quixote?",
    "Who wrote War and Peace?", "Who wrote the Odyssey?", "Who wrote Nineteen Eighty-Four?",
    "Who wrote Moby-Dick?", "Who wrote The Divine Comedy?", "Who wrote Oliver Twist?",
    "Which planet is closest to the Sun?", "Which planet is famous for its rings?",
    "Which planet is farthest from the Sun?", "Which planet is the hottest in the solar system?",
    "Which planet do we live on?", "What is the name of Earth's natural satellite?",
    "What is the chemical symbol for silver?", "What is the chemical symbol for iron?",
    "What is the chemical symbol for sodium?", "What is the chemical symbol for oxygen?",
    "Which element has the atomic number 1?", "What gas do humans breathe out?",
    "What is the hardest natural substance?",
    "Who discovered penicillin?", "Who invented the telephone?", "Who invented the light bulb?",
    "Who invented the printing press?", "Who were the first people to fly an aeroplane?",
    "Who was the first person to walk on the Moon?", "Who proposed the theory of evolution?",
    "Who discovered gravity when an apple fell?", "In which country is the Eiffel Tower?",
    "In which country is the Colosseum?", "In which country is the Taj Mahal?",
    "In which country is Machu Picchu?", "In which country is the Great Wall?",
    "In which city is the Statue of Liberty?", "What is the longest river in the world?",
    "What is the largest desert in the world?", "What is the largest country by area?",
    "What is the smallest country in the world?", "What is the largest continent?",
    "What is the capital city of Australia?", "What is the capital city of Canada?",
    "What is the capital city of Spain?", "What is the currency of the United States?",
    "What is the currency of the United Kingdom?", "Which language is spoken in Brazil?",
    "Which animal is known as the ship of the desert?", "Which animal is called man's best friend?",
    "What is the fastest land animal?", "What is the tallest animal?", "Which bird cannot fly and lives in Antarctica?",
    "What do cows drink?", "What do pandas eat?",
    "How many wheels does a bicycle have?", "How many strings does a violin have?",
    "How many players are on a football team?", "How many sides does a hexagon have?",
    "How many weeks are in a year?", "How many days are in June?",
    "What is 7 times 8?", "What is half of 50?", "What is 100 minus 37?",
    "Which month comes after March?", "What colour is grass?",
    "What colour are bananas when they are ripe?", "Which organ do we use to breathe?",
    "Which organ controls the body?", "How many bones are in the adult human body?",
    "What do plants give off into the air?",
    "What is the largest bird?", "What is the largest fish?", "Which ocean lies between Europe and America?",
]  # fmt: skip
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
    """Every template with every filler (numbers drawn) and the quiz questions, deduplicated, without the
    held-out and knowledge questions, shuffled with `seed`."""
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
    prompts.update(QUIZ_QUESTIONS)
    ordered = sorted(prompts - set(HELD_OUT_QUESTIONS) - {q for q, _ in KNOWLEDGE_QUESTIONS})
    rng.shuffle(ordered)
    return ordered
