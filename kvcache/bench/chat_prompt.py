"""The engine bench's chat: a long system prompt (a library help desk's house rules, in plain
English) and short questions, rendered with the model's own chat template, so the prompt is what
a deployment sends: the template's special tokens and roles around real text.

The system prompt grows rule by rule until the rendered chat is as long as asked; every chat is
that system prompt and one question, so chats share the system prompt's pages, as a deployment's
requests do, and diverge at the question. The same model and length give the same tokens on
every machine.
"""

from __future__ import annotations

SUBJECTS = (
    "a lost library card", "overdue books", "the reading room", "printing and copying", "the children's corner",
    "interlibrary loans", "the public computers", "rare books", "study room bookings", "donations of old books",
    "the music collection", "events and talks", "the local history archive", "accessibility needs", "the cafe",
)
GUIDANCE = (
    "explain the rule in one or two short sentences and offer the next step",
    "ask one clarifying question before giving any advice",
    "give the opening hours of the desk that handles it and say where that desk is",
    "be friendly and brief, and never invent a fee or a date you were not given",
    "point the visitor to the form on the library's website and describe what it asks for",
    "say that a librarian on the first floor can help in person if the answer is not enough",
    "summarize the policy, then list at most three things the visitor should bring",
)
QUESTIONS = (
    "What is the capital of France?",
    "How long can I keep a book before it is overdue?",
    "Can I print a document in colour here?",
    "Where do I find books about the history of this town?",
    "Is there a quiet room where I can study for my exams?",
    "My daughter lost her library card. What should we do?",
    "Do you accept donations of old encyclopedias?",
    "Can I borrow a book from another library through you?",
    "Are there talks or readings this month?",
    "Is the building accessible for wheelchairs?",
    "Can I use a computer without a library card?",
    "How do I book a study room for four people?",
)


def system_prompt(num_rules: int) -> str:
    """The help desk's house rules, `num_rules` of them."""
    lines = ["You are the help desk assistant of the city library. Answer visitors' questions "
             "politely and accurately, following these house rules."]
    for i in range(num_rules):
        subject = SUBJECTS[i % len(SUBJECTS)]
        guidance = GUIDANCE[(3 * i + i // len(SUBJECTS)) % len(GUIDANCE)]
        lines.append(f"Rule {i + 1}: when a visitor asks about {subject}, {guidance}.")
    lines.append("If a question has nothing to do with the library, answer it briefly anyway.")
    return "\n".join(lines)


class BenchChat:
    """Chats of `questions` questions, the longest at most `tokens` tokens, for `model` (which
    must have a chat template)."""

    def __init__(self, model, tokens: int, questions: int):
        self.model = model
        self.num_rules = 0
        self.system = system_prompt(0)
        shortest = max(len(self.token_ids(q)) for q in range(questions))
        if shortest > tokens:
            raise ValueError(f"the bench's chats take at least {shortest} tokens in {model.name}'s template; "
                             f"ask for that many or more")
        while self.num_rules < 10_000:
            self.system = system_prompt(self.num_rules + 1)
            if max(len(self.token_ids(q)) for q in range(questions)) > tokens:
                self.system = system_prompt(self.num_rules)
                break
            self.num_rules += 1

    def token_ids(self, question: int) -> list[int]:
        """The chat of question number `question` (any integer: questions repeat, numbered)."""
        text = QUESTIONS[question % len(QUESTIONS)]
        if question >= len(QUESTIONS):
            text = f"(question {question}) {text}"
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": text}]
        return self.model.chat_token_ids(messages)
