"""The demo model evaluation's scoring: exact answers after normalising, knowledge answers by whole words."""

from __future__ import annotations

from tools.eval_demo_model import knows, normalise


def test_an_answer_is_normalised_before_the_exact_match():
    assert normalise("  Red.\n") == "red" and normalise("the red circle") == "the red circle"


def test_knowledge_is_found_as_a_whole_word_in_any_case():
    assert knows("The capital is London.", ("london",))
    assert knows("It has 8 legs", ("eight", "8")) and knows("Eight legs.", ("eight", "8"))
    assert not knows("It has 18 legs", ("8",))  # inside another number
    assert not knows("The Earth is 7,982,180 km across", ("seven", "7"))  # a digit of a grouped number
    assert not knows("About 9.5", ("9",)) and knows("It boils at 100.0 degrees.", ("100",))  # by value
    assert knows("There are 7, or 8 by some counts.", ("7",))  # a comma that groups no thousands
    assert not knows("Londoners say so", ("london",))  # inside another word
    assert not knows("Paris", ("london", "rome"))
