"""The interleaved chat benchmark's conversation, fixed in advance: each user's system prompt of natural-looking
English (seeded word lists), the user messages and the assistant turns every server sees alike."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SYSTEM_TOKENS = 660

TOPICS = [
    ("a small bakery", "bread", "customers", "oven"),
    ("a city library", "books", "readers", "catalogue"),
    ("a bicycle repair shop", "wheels", "riders", "workshop"),
    ("a mountain hotel", "rooms", "guests", "kitchen"),
    ("a community garden", "vegetables", "volunteers", "greenhouse"),
    ("a music school", "lessons", "students", "piano"),
    ("a ferry company", "tickets", "passengers", "harbour"),
    ("a veterinary clinic", "animals", "owners", "waiting room"),
]
ADJECTIVES = """quiet busy careful friendly modern old small large bright early late simple useful warm cold heavy
light careful clear local seasonal fresh regular rare common important patient honest gentle steady quick slow
narrow wide famous ordinary special daily weekly monthly favourite expensive cheap reliable polite helpful""".split()
NOUNS = """morning evening window table garden street market letter question answer decision problem reason
picture story lesson meeting visitor neighbour family friend teacher manager driver weather season holiday
schedule notice request order delivery payment receipt booking record account message phone list plan price
budget report corner door shelf basket bottle umbrella jacket ticket map journey road bridge river hill""".split()
VERBS = """opens closes prepares checks explains answers remembers describes arranges collects delivers repairs
recommends welcomes reminds cleans organises visits measures changes writes reads records follows improves
protects shares suggests compares""".split()
ADVERBS = """usually often always sometimes rarely carefully quickly politely calmly quietly gladly briefly
patiently clearly promptly""".split()
PLACES = [
    "near the entrance", "behind the counter", "at the front desk", "in the back room", "by the window",
    "on the top floor", "next to the stairs", "in the courtyard", "at the end of the hall", "beside the main door",
]
TIMES = [
    "on Monday mornings", "before lunch", "after closing time", "during the holidays", "at the start of each month",
    "every other week", "in the late afternoon", "when it rains", "on busy weekends",
    "before the first visitors arrive",
]
RULES = [
    "Always answer in a short and friendly way.",
    "If you do not know something, say so and suggest who could help.",
    "Never promise a price or a date that is not written here.",
    "Keep personal details private and do not repeat them.",
    "When a question is unclear, ask one short question back.",
    "Prefer plain words to technical ones.",
]
USER_MESSAGES = [
    "Hi! Are you open tomorrow?",
    "What should I bring with me?",
    "Can you say that in one sentence?",
    "Is there anything new this week?",
    "Who should I ask about a refund?",
    "Thanks. What time is best to come?",
    "Do I need to book in advance?",
    "Could you remind me of the rules?",
]
ASSISTANT_REPLIES = [
    "Yes, we are open tomorrow from nine in the morning until six in the evening. You are welcome to drop by.",
    "Just bring your booking reference and a little patience on busy days. Everything else is provided here.",
    "Of course: come early, bring your reference, and ask the front desk if anything is unclear.",
    "This week we have a few new seasonal items and slightly longer opening hours on Friday.",
    "Please ask the manager at the front desk; they handle refunds and will need your receipt.",
    "Early mornings are usually the quietest, so that is the best time to come if you can.",
]


def _sentence(rng: random.Random, topic: tuple[str, str, str, str]) -> str:
    _, thing, people, room = topic
    a, b = rng.sample(ADJECTIVES, 2)
    n1, n2 = rng.sample(NOUNS, 2)
    forms = [
        f"The {a} {n1} {rng.choice(VERBS)} the {b} {n2} {rng.choice(TIMES)}.",
        f"Our {people} {rng.choice(ADVERBS)} ask about the {n1} {rng.choice(PLACES)}.",
        f"The staff {rng.choice(ADVERBS)} {rng.choice(VERBS)} the {thing} and keeps the {room} {a}.",
        f"{rng.choice(TIMES).capitalize()} the team {rng.choice(VERBS)} every {n1} {rng.choice(PLACES)}.",
        f"A {a} {n2} is kept {rng.choice(PLACES)} so that {people} can find the {b} {n1}.",
        f"If a {n1} is {a}, the manager {rng.choice(VERBS)} it {rng.choice(TIMES)}.",
    ]
    return rng.choice(forms)


def system_prompt(user: int, n_tokens: int = SYSTEM_TOKENS, count: Any = None) -> str:
    """The system prompt of ``user``: deterministic (seeded by ``user``), sentences added while the text stays within
    ``n_tokens`` tokens according to ``count`` (text -> token count; about 1.3 tokens a word without one)."""
    rng = random.Random(1000 + user)
    topic = TOPICS[user % len(TOPICS)]
    count = count or (lambda text: int(len(text.split()) * 1.3))
    paragraphs = [[f"You are the assistant of {topic[0]} (desk number {user + 1}). Here is what you need to know.",
                   rng.choice(RULES)]]
    text = ""
    while True:
        if len(paragraphs[-1]) == 4:
            paragraphs.append([])
        paragraphs[-1].append(_sentence(rng, topic))
        candidate = "\n\n".join(" ".join(p) for p in paragraphs)
        if count(candidate) > n_tokens:
            return text
        text = candidate


def token_counter(model: str) -> Any:
    """Text -> number of tokens of ``model``'s tokenizer (a vocabulary-only load, no weights)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=model, vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=False, special=False))


@dataclass(frozen=True)
class Request:
    index: int
    user: int
    turn: int
    messages: list[dict[str, str]]


def conversation(users: int, turns: int, count: Any = None) -> list[Request]:
    """Every request of the workload, in order: turn by turn, users round-robin inside a turn."""
    histories = [[{"role": "system", "content": system_prompt(u, count=count)}] for u in range(users)]
    requests = []
    for turn in range(turns):
        for user in range(users):
            history = histories[user]
            history.append({"role": "user", "content": USER_MESSAGES[(user * 3 + turn) % len(USER_MESSAGES)]})
            requests.append(Request(len(requests), user, turn, [dict(m) for m in history]))
            history.append({"role": "assistant", "content": ASSISTANT_REPLIES[(user + turn) % len(ASSISTANT_REPLIES)]})
    return requests
