"""tools/demo_vlm_phrasings.py: enough phrasings per kind, a held-out share, and splits that never meet."""

from __future__ import annotations

import pytest

from tools.demo_vlm_phrasings import HELD_OUT, TEMPLATES, split_templates


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_each_kind_holds_out_about_a_quarter_of_its_phrasings(kind):
    templates, held = TEMPLATES[kind], HELD_OUT[kind]
    if kind.startswith("compound_"):  # the ways of joining questions: few, one held out
        assert len(set(templates)) == len(templates) >= 4 and len(held) == 1 and set(held) <= set(templates)
        return
    assert len(set(templates)) == len(templates) >= 8
    assert set(held) <= set(templates) and 2 <= len(held) <= 0.35 * len(templates)


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_train_and_eval_phrasings_are_disjoint_and_cover_the_kind(kind):
    train, held = split_templates(kind, "train"), split_templates(kind, "eval")
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(TEMPLATES[kind])


def test_relation_holds_out_a_yes_no_and_a_which_phrasing():
    held = HELD_OUT["relation"]
    assert any("{a}" in t for t in held) and any("{a}" not in t for t in held)


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        split_templates("colour", "test")
