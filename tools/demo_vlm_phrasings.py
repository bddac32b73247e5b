"""The question phrasings of the demo VLM's synthetic VQA (tools/demo_vlm_data), per question kind.

``TEMPLATES[kind]`` holds at least 8 phrasings per kind, with the fields the question generator fills in
(``{obj}``/``{Obj}``: an object's unique description; ``{things}``: what to count; ``{a}``, ``{rel}``, ``{b}``: a
relation; ``{thing}``: "word" or "number"; the user kinds' fields are in ``tools/demo_vlm_user_kinds``), then
a group per form of the kinds that have several. ``HELD_OUT[kind]`` (about a quarter, at least 2, for ``relation``
both a yes/no one and a which one) never occur in the ``"train"`` split and are the only phrasings of the
``"eval"`` split, so the evaluation asks in words the model never saw.
"""

from __future__ import annotations

TEMPLATES = {
    "colour": [
        "What colour is {obj}?", "What is the colour of {obj}?", "Which colour does {obj} have?",
        "Tell me the colour of {obj}.", "{Obj} is what colour?", "What colour is {obj} in the image?",
        "Name the colour of {obj}.", "Which colour is {obj}?", "What is {obj}'s colour?",
        "Identify the colour of {obj}.", "In what colour is {obj} drawn?", "What colour has {obj} got?",
    ],
    "shape": [
        "What shape is {obj}?", "What is the shape of {obj}?", "Which shape is {obj}?",
        "Name the shape of {obj}.", "{Obj} has what shape?", "What kind of shape is {obj}?",
        "Tell me the shape of {obj}.", "What shape does {obj} have?", "Which shape does {obj} have?",
        "Identify the shape of {obj}.", "What is {obj} shaped like?", "What form does {obj} take?",
        "{Obj} is shaped like what?", "What shape would you say {obj} is?", "What geometric shape is {obj}?",
        "What is the form of {obj}?", "Which form does {obj} have?", "What would you say {obj} is shaped like?",
        "What is {obj}'s shape?", "What is {obj}, shape-wise?",
    ],
    "count": [
        "How many {things} are there?", "How many {things} can you see?", "Count the {things}.",
        "What is the number of {things}?", "How many {things} are in the image?", "Count the {things} in the picture.",
        "Tell me how many {things} there are.", "How many {things} are shown?", "Give the number of {things}.",
        "How many {things} do you see?", "How many {things} does the image contain?", "How many {things} are visible?",
        "How many {things} does the picture contain?", "How many {things} does the picture have?",
        "How many {things} are drawn?", "How many {things} does the image show?",
        "How many {things} can be seen?", "How many {things} are present?", "How many {things} do you count?",
        "How many {things} appear in the image?",
    ],
    "position": [
        "Where is {obj}?", "In which part of the image is {obj}?", "Is {obj} on the left, right, top or bottom?",
        "Where in the picture is {obj} located?", "Which side of the image is {obj} on?", "Where can {obj} be found?",
        "Tell me where {obj} is.", "What is the position of {obj}?", "Where is {obj} placed?",
        "On which side is {obj}?", "Which region of the image contains {obj}?", "Where does {obj} appear?",
        "Which part of the picture contains {obj}?", "Which area of the image holds {obj}?",
        "In which region is {obj}?", "Which part of the image has {obj} in it?",
        "On what side of the picture is {obj}?",
        "Where do you see {obj}?", "Where is {obj} located?", "Which side is {obj} on?",
    ],
    "relation": [
        "Is {a} {rel} {b}?", "Is it true that {a} is {rel} {b}?", "Is {a} located {rel} {b}?",
        "Answer yes or no: is {a} {rel} {b}?", "Would you say {a} is {rel} {b}?", "Does {a} appear {rel} {b}?",
        "Which shape is {rel} {b}?", "What shape is found {rel} {b}?", "Which object is {rel} {b}?",
        "Name the shape {rel} {b}.", "Which shape lies {rel} {b}?", "Tell me which shape is {rel} {b}.",
        "What is {rel} {b}?", "What is drawn {rel} {b}?", "Does {a} lie {rel} {b}?", "Is {a} placed {rel} {b}?",
        "Which shape sits {rel} {b}?", "Which object can be seen {rel} {b}?",
        "Is {a} found {rel} {b}?", "Can {a} be seen {rel} {b}?", "Do you see {a} {rel} {b}?",
        "Is {a} positioned {rel} {b}?", "Would you agree that {a} is {rel} {b}?", "Yes or no: is {a} {rel} {b}?",
        "Which shape can you see {rel} {b}?", "What do you see {rel} {b}?", "Which shape appears {rel} {b}?",
        "Which shape is located {rel} {b}?",
    ],
    "reading": [
        "What {thing} is written in the image?", "What {thing} is shown?", "Read the {thing} in the picture.",
        "Which {thing} can you see?", "What is the {thing} in the image?", "Tell me the {thing} written here.",
        "What does the {thing} in the image say?", "Which {thing} appears in the picture?",
        "What {thing} do you see written?", "Read out the {thing} in the image.", "What is the written {thing}?",
        "Which {thing} is printed in the image?",
    ],
    "describe": [
        "Describe the image.", "What is in the image?", "List the objects from left to right.",
        "What do you see?", "Describe the picture from left to right.", "What objects are shown, from left to right?",
        "Give a short description of the image.", "What does the image contain?", "Describe what is shown.",
        "List what you see, left to right.", "Caption this image.",
        "Name everything in the picture from left to right.", "Write a caption for the picture.",
        "Give this picture a short caption.",
    ],
    # the kinds of tools/demo_vlm_user_kinds.py; a kind with several forms has a group per form
    "existence": [
        "Is there {a_thing}?", "Is there {a_thing} in the image?", "Can you see {a_thing}?", "Do you see {a_thing}?",
        "Does the image contain {a_thing}?", "Is there {a_thing} in the picture?", "Does the picture have {a_thing}?",
        "Can you find {a_thing} in the image?", "Are there any {things}?", "Are there any {things} in the image?",
        "Do you see any {things}?", "Can you see any {things}?", "Does the image have any {things}?",
        "Are there {things} in the picture?",
        "Do you notice {a_thing}?", "Do you spot {a_thing}?", "Is {a_thing} visible?", "Is {a_thing} present?",
        "Would you say there is {a_thing}?", "Does the image show {a_thing}?", "Do you notice any {things}?",
        "Are any {things} visible?", "Do any {things} appear in the image?", "Can any {things} be seen?",
    ],
    "absent": [
        "Which of these colours is not in the image: {options}?", "Which colour is missing: {options}?",
        "Which of {options} does not appear in the image?", "Of {options}, which colour is absent?",
        "Which colour can't you see: {options}?", "Which of the colours {options} is not present?",
        "Which colour is not present: {options}?", "Which of these colors is not in the picture: {options}?",
        "Which color is missing from the image: {options}?", "Of the colours {options}, which one is not there?",
    ],
    "middle_colour": [
        "What colour is {mid}?", "What is the colour of {mid}?", "Which colour is {mid}?", "What color is {mid}?",
        "Tell me the colour of {mid}.", "What color does {mid} have?", "Name the colour of {mid}.",
        "In what colour is {mid} drawn?",
    ],
    "middle_shape": [
        "What shape is {mid}?", "What is the shape of {mid}?", "Which shape is {mid}?", "Name the shape of {mid}.",
        "What kind of shape is {mid}?", "Tell me the shape of {mid}.", "What is {mid} shaped like?",
        "What form does {mid} take?", "What shape would you say {mid} is?", "What geometric shape is {mid}?",
        "What is the form of {mid}?", "What would you say {mid} is shaped like?", "Which shape would you say {mid} is?",
        "What is {mid}'s shape?", "What sort of shape is {mid}?", "What is {mid}, shape-wise?",
        "What is {mid} like in shape?", "What shape does {mid} have?",
        "Which form does {mid} have?", "Which geometric shape is {mid}?", "What shape is {mid} drawn as?",
    ],
    "middle_name": [
        "What is in the middle?", "What is in the centre of the image?", "Which shape is in the center?",
        "What is in the middle of the picture?", "Which object is in the centre?", "What is drawn in the middle?",
        "What do you see in the center of the image?", "Which shape sits in the middle?",
        "Which shape is at the centre?", "Which shape lies in the middle?", "Which object sits in the center?",
        "Which shape is in the middle of the picture?", "Which shape can you see in the centre?",
        "Which object is placed in the middle?", "Which shape is placed at the center?",
        "What is at the centre?", "What sits in the centre?", "What can you see in the middle?",
        "Which object is at the center of the image?", "What is located in the middle?",
    ],
    "middle_ref": [
        "the shape in the middle", "the shape in the centre", "the shape in the center", "the object in the middle",
        "the one in the middle", "the shape at the centre", "the object in the centre", "the thing in the middle",
        "the item in the middle", "the central shape", "the central object", "the one in the centre",
        "the shape right in the middle",
    ],
    "greeting": [
        "Hello", "Hello!", "Hi", "Hi!", "Hey", "Hey!", "Hello there", "Good morning!", "Good evening",
        "Hi, how are you?", "Hey there!", "Greetings!", "Hello, how are you?", "Hi there!", "Good afternoon!",
        "Howdy!", "Hiya!", "Good day!", "Morning!", "Yo!", "Hey, how's it going?", "Hello, nice to meet you!",
        "Hi, what's up?", "Heya", "Hi friend!",
    ],
    "compound_2": ["{q1}, and {q2}?", "{q1}? {q2}?", "{q1}? Also, {q2}?", "{q1}? And {q2}?", "{q1}, and also {q2}?",
                   "{q1} and {q2}?", "{q1} and also {q2}?"],  # as people type: no comma before "and"
    "compound_3": ["{q1}, {q2}, and {q3}?", "{q1}? {q2}? {q3}?", "{q1}? Also, {q2}? And {q3}?",
                   "{q1}, {q2} and {q3}?", "{q1}, {q2} and also {q3}?", "{q1}? {q2} and {q3}?",
                   "{q1}, {q2}, {q3}?"],  # a bare "and" or none between the last two, as people type
}  # fmt: skip
HELD_OUT = {
    "colour": ["Identify the colour of {obj}.", "In what colour is {obj} drawn?", "What colour has {obj} got?"],
    "shape": ["Identify the shape of {obj}.", "What is {obj} shaped like?", "What form does {obj} take?"],
    "count": ["How many {things} do you see?", "How many {things} does the image contain?",
              "How many {things} are visible?"],
    "position": ["On which side is {obj}?", "Which region of the image contains {obj}?", "Where does {obj} appear?"],
    "relation": ["Would you say {a} is {rel} {b}?", "Does {a} appear {rel} {b}?", "Which shape lies {rel} {b}?",
                 "Tell me which shape is {rel} {b}."],
    "reading": ["What {thing} do you see written?", "Read out the {thing} in the image.",
                "What is the written {thing}?", "Which {thing} is printed in the image?"],
    "describe": ["Caption this image.", "Name everything in the picture from left to right.",
                 "List what you see, left to right."],
    "existence": ["Do you see {a_thing}?", "Is there {a_thing} in the picture?", "Do you see any {things}?",
                  "Are there {things} in the picture?"],
    "absent": ["Which colour is not present: {options}?", "Which of these colors is not in the picture: {options}?",
               "Of the colours {options}, which one is not there?"],
    "middle_colour": ["Name the colour of {mid}.", "In what colour is {mid} drawn?"],
    "middle_shape": ["What is {mid} shaped like?", "What form does {mid} take?"],
    "middle_name": ["What do you see in the center of the image?", "Which shape sits in the middle?"],
    "middle_ref": ["the object in the centre", "the thing in the middle"],
    "greeting": ["Hello, how are you?", "Hi there!", "Good afternoon!", "Howdy!"],
    "compound_2": ["{q1}, and also {q2}?"],
    "compound_3": ["{q1}, {q2} and {q3}?"],
}  # fmt: skip


def split_templates(kind: str, split: str) -> list[str]:
    """The phrasings of a kind that a split may use: the held-out ones for "eval", the others for "train"."""
    if split == "eval":
        return list(HELD_OUT[kind])
    if split == "train":
        return [t for t in TEMPLATES[kind] if t not in HELD_OUT[kind]]
    raise ValueError(f"unknown split {split!r}")
