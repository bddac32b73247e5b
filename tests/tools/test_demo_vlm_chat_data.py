"""tools/demo_vlm_chat_data.py: the distillation prompts never hold a question the evaluation asks."""

import re

from tools.demo_vlm_chat_data import HELD_OUT_QUESTIONS, KNOWLEDGE_QUESTIONS, QUIZ_QUESTIONS, general_prompts


def _norm(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def test_general_prompts_hold_no_evaluated_question():
    asked = {_norm(q) for q in HELD_OUT_QUESTIONS} | {_norm(q) for q, _ in KNOWLEDGE_QUESTIONS}
    prompts = general_prompts(0)
    assert len(prompts) == len(set(prompts)) > 300
    assert not asked & {_norm(p) for p in prompts}


def test_general_prompts_include_the_quiz_questions_in_a_seeded_order():
    first, again, other = general_prompts(3), general_prompts(3), general_prompts(4)
    assert first == again and first != other
    assert set(QUIZ_QUESTIONS) <= set(first)


def test_quiz_questions_ask_no_knowledge_answer():
    # a quiz question naming a knowledge question's answer (Mars, Leonardo, ...) would teach that fact
    answers = {word for _, words in KNOWLEDGE_QUESTIONS for word in words if len(word) > 3 and word.isalpha()}
    named = {(q, w) for q in QUIZ_QUESTIONS for w in answers if re.search(rf"\b{w}\b", q.lower())}
    assert not named
