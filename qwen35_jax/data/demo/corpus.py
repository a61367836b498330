"""The demo corpus: English-like text about a small made-up world, generated deterministically.

Every animal has one colour, one home and one food, and the sentences keep to those facts, so a model
that learns from the corpus comes to prefer "the fox eats berries" over "the fox eats stones". Text
rows are short stories; chat rows ask about the facts and answer them.
"""

from __future__ import annotations

import random

# animal: (colour, home, food)
ANIMALS = {
    "fox": ("red", "forest", "berries"),
    "owl": ("brown", "barn", "mice"),
    "frog": ("green", "pond", "flies"),
    "bear": ("black", "cave", "honey"),
    "swan": ("white", "lake", "weeds"),
    "goat": ("grey", "hill", "grass"),
    "crab": ("orange", "beach", "shrimp"),
    "mole": ("dark", "burrow", "worms"),
    "duck": ("yellow", "river", "bread"),
    "wolf": ("silver", "valley", "deer"),
    "bee": ("golden", "hive", "nectar"),
    "seal": ("spotted", "harbour", "fish"),
}
NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
TIMES = ["In the morning", "At noon", "In the evening", "At night", "One day", "Every spring"]
VERBS = ["saw", "met", "watched", "followed", "found", "greeted"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _fact(rng: random.Random, animal: str) -> str:
    colour, home, food = ANIMALS[animal]
    return rng.choice([
        f"The {animal} is {colour}.",
        f"The {colour} {animal} lives in the {home}.",
        f"The {animal} eats {food}.",
        f"In the {home}, the {animal} looks for {food}.",
        f"A {animal} is always {colour} and likes {food}.",
    ])


def _event(rng: random.Random) -> str:
    animal = rng.choice(sorted(ANIMALS))
    colour, home, food = ANIMALS[animal]
    name = rng.choice(NAMES)
    count = rng.randrange(2, 10)
    return rng.choice([
        f"{rng.choice(TIMES)}, {name} {rng.choice(VERBS)} the {colour} {animal} near the {home}.",
        f"{name} counted {NUMBERS[count - 1]} {animal}s: {', '.join(NUMBERS[:count])}.",
        f"{name} brought {food} to the {home}, and the {animal} ate it all.",
        f"{rng.choice(TIMES)}, the {animal} left the {home} to find {food}.",
    ])


def story(rng: random.Random) -> str:
    """A paragraph of three to seven sentences mixing facts and events."""
    sentences = []
    for _ in range(rng.randrange(3, 8)):
        if rng.random() < 0.5:
            sentences.append(_fact(rng, rng.choice(sorted(ANIMALS))))
        else:
            sentences.append(_event(rng))
    return " ".join(sentences)


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """One to three question/answer turns about the facts, sometimes after a system message."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You answer questions about the animals."})
    for _ in range(rng.randrange(1, 4)):
        animal = rng.choice(sorted(ANIMALS))
        colour, home, food = ANIMALS[animal]
        question, answer = rng.choice([
            (f"What colour is the {animal}?", f"The {animal} is {colour}."),
            (f"Where does the {animal} live?", f"The {animal} lives in the {home}."),
            (f"What does the {animal} eat?", f"The {animal} eats {food}."),
        ])
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def probes() -> list[tuple[str, str, str]]:
    """(prompt, right continuation, wrong continuation) for each animal's food."""
    foods = [ANIMALS[a][2] for a in sorted(ANIMALS)]
    out = []
    for i, animal in enumerate(sorted(ANIMALS)):
        wrong = foods[(i + 5) % len(foods)]
        out.append((f"The {animal} eats", f" {ANIMALS[animal][2]}.", f" {wrong}."))
    return out
