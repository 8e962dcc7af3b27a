"""Generate the synthetic training corpus of radixlm's built-in demo model.

Facts about countries (capital, population, continent, language), greetings, short questions and
answers in a ChatML-style chat format, and the same facts as compact JSON records. Deterministic
for a given seed, so anyone can rebuild the model.

    python3 tools/demo_model/corpus.py --out /tmp/corpus.txt
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    population_millions: int
    continent: str
    language: str
    capital_population: int


# Rounded figures; the demo model needs consistent facts, not a census.
COUNTRIES = [
    Country("France", "Paris", 68, "Europe", "French", 2102650),
    Country("England", "London", 57, "Europe", "English", 8866180),
    Country("Germany", "Berlin", 84, "Europe", "German", 3755251),
    Country("Italy", "Rome", 59, "Europe", "Italian", 2748109),
    Country("Spain", "Madrid", 48, "Europe", "Spanish", 3332035),
    Country("Portugal", "Lisbon", 10, "Europe", "Portuguese", 545796),
    Country("Netherlands", "Amsterdam", 18, "Europe", "Dutch", 931298),
    Country("Belgium", "Brussels", 12, "Europe", "French", 1222637),
    Country("Switzerland", "Bern", 9, "Europe", "German", 134591),
    Country("Austria", "Vienna", 9, "Europe", "German", 2005760),
    Country("Poland", "Warsaw", 37, "Europe", "Polish", 1861975),
    Country("Sweden", "Stockholm", 11, "Europe", "Swedish", 984748),
    Country("Norway", "Oslo", 6, "Europe", "Norwegian", 717710),
    Country("Finland", "Helsinki", 6, "Europe", "Finnish", 674963),
    Country("Greece", "Athens", 10, "Europe", "Greek", 643452),
    Country("Ireland", "Dublin", 5, "Europe", "English", 592713),
    Country("Japan", "Tokyo", 124, "Asia", "Japanese", 14094034),
    Country("China", "Beijing", 1410, "Asia", "Chinese", 21893095),
    Country("India", "New Delhi", 1430, "Asia", "Hindi", 249998),
    Country("Korea", "Seoul", 52, "Asia", "Korean", 9411260),
    Country("Thailand", "Bangkok", 72, "Asia", "Thai", 10539000),
    Country("Vietnam", "Hanoi", 99, "Asia", "Vietnamese", 8435700),
    Country("Indonesia", "Jakarta", 278, "Asia", "Indonesian", 10562088),
    Country("Turkey", "Ankara", 85, "Asia", "Turkish", 5803482),
    Country("Egypt", "Cairo", 112, "Africa", "Arabic", 10230350),
    Country("Kenya", "Nairobi", 55, "Africa", "Swahili", 4397073),
    Country("Nigeria", "Abuja", 223, "Africa", "English", 1235880),
    Country("Morocco", "Rabat", 37, "Africa", "Arabic", 577827),
    Country("Ghana", "Accra", 34, "Africa", "English", 2514005),
    Country("Ethiopia", "Addis Ababa", 126, "Africa", "Amharic", 3945000),
    Country("Canada", "Ottawa", 40, "North America", "English", 1017449),
    Country("Mexico", "Mexico City", 128, "North America", "Spanish", 9209944),
    Country("Cuba", "Havana", 11, "North America", "Spanish", 2130081),
    Country("Brazil", "Brasilia", 216, "South America", "Portuguese", 2817068),
    Country("Argentina", "Buenos Aires", 46, "South America", "Spanish", 3121707),
    Country("Chile", "Santiago", 20, "South America", "Spanish", 6160040),
    Country("Peru", "Lima", 34, "South America", "Spanish", 10092000),
    Country("Colombia", "Bogota", 52, "South America", "Spanish", 7907281),
    Country("Australia", "Canberra", 27, "Oceania", "English", 456692),
    Country("New Zealand", "Wellington", 5, "Oceania", "English", 215400),
]

GREETINGS = ["Hello", "Hi", "Hey", "Good morning", "Good evening", "Welcome"]
SYSTEM_PROMPT = "You are a helpful assistant."


def chat(user: str, assistant: str, system: bool) -> str:
    """One exchange in the ChatML-style format of the demo model's chat template."""
    head = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n" if system else ""
    return (
        f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"
    )


def fact_sentences(c: Country) -> list[str]:
    return [
        f"The capital of {c.name} is {c.capital}.",
        f"{c.capital} is the capital of {c.name}.",
        f"{c.name} is a country in {c.continent}.",
        f"The population of {c.name} is about {c.population_millions} million.",
        f"People in {c.name} speak {c.language}.",
        f"{c.capital} has a population of {c.capital_population}.",
        f"{c.capital} is a city in {c.continent}.",
    ]


def json_record(c: Country, rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        record = {"name": c.capital, "population": c.capital_population}
        intro = f"Here is the information of the capital of {c.name} in the JSON format.\n"
    elif kind == 1:
        record = {"country": c.name, "capital": c.capital, "continent": c.continent}
        intro = f"{c.name} as a JSON record:\n"
    else:
        record = {
            "country": c.name,
            "capital": c.capital,
            "population": c.population_millions * 1_000_000,
            "language": c.language,
        }
        intro = f"The facts about {c.name} in JSON:\n"
    return intro + json.dumps(record, separators=(",", ":"))


def qa_pair(c: Country, rng: random.Random) -> tuple[str, str]:
    options = [
        (f"What is the capital of {c.name}?", f"The capital of {c.name} is {c.capital}."),
        (f"Which continent is {c.name} in?", f"{c.name} is in {c.continent}."),
        (f"What language do people speak in {c.name}?", f"People in {c.name} speak {c.language}."),
        (
            f"How many people live in {c.name}?",
            f"About {c.population_millions} million people live in {c.name}.",
        ),
        (
            f"{c.capital} is the capital of which country?",
            f"{c.capital} is the capital of {c.name}.",
        ),
    ]
    return rng.choice(options)


def list_answer(rng: random.Random, count: int) -> tuple[str, str]:
    # Consecutive entries of the table from a random start: after "1. France: Paris" the next
    # line is predictable, so greedy decoding lists distinct pairs instead of repeating one.
    start = rng.randrange(len(COUNTRIES))
    picked = [COUNTRIES[(start + i) % len(COUNTRIES)] for i in range(count)]
    lines = [f"{i + 1}. {c.name}: {c.capital}" for i, c in enumerate(picked)]
    return f"List {count} countries and their capitals.", "\n".join(lines)


def documents(rng: random.Random, count: int) -> list[str]:
    """`count` training documents, each a few hundred characters at most."""
    docs: list[str] = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.3:
            c = rng.choice(COUNTRIES)
            sentences = fact_sentences(c)
            rng.shuffle(sentences)
            docs.append(" ".join(sentences[: rng.randint(2, 5)]))
        elif kind < 0.45:
            docs.append(json_record(rng.choice(COUNTRIES), rng))
        elif kind < 0.75:
            user, answer = qa_pair(rng.choice(COUNTRIES), rng)
            docs.append(chat(user, answer, system=rng.random() < 0.5))
        elif kind < 0.85:
            user, answer = list_answer(rng, rng.choice([2, 3, 3, 4, 5]))
            docs.append(chat(user, answer, system=rng.random() < 0.5))
        elif kind < 0.95:
            greeting = rng.choice(GREETINGS)
            user = rng.choice(["Write a greeting.", "Say hello.", "Greet me."])
            docs.append(chat(user, f"{greeting}!", system=rng.random() < 0.5))
        else:
            c = rng.choice(COUNTRIES)
            docs.append(
                f"{rng.choice(GREETINGS)}! Welcome to {c.capital}, the capital of {c.name}."
            )
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--documents", type=int, default=60_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    docs = documents(random.Random(args.seed), args.documents)
    args.out.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    print(f"wrote {len(docs)} documents, {sum(map(len, docs))} characters to {args.out}")


if __name__ == "__main__":
    main()
