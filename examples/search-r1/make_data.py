"""Write qa.jsonl: a chat prompt per question (the search-r1 instructions plus the question) and its answer."""

import json
from pathlib import Path

INSTRUCTIONS = (
    "Answer the question. Think inside <think> and </think>. To look something up, write <search> query </search>; "
    "the best passages come back inside <information> and </information>. Search as often as you need, then give "
    "only the final answer inside <answer> and </answer>, for example <answer> Paris </answer>."
)
QUESTIONS = [
    ("What is the capital of Australia?", "Canberra"),
    ("Which river carries more water than any other river?", "Amazon River"),
    ("What is the deepest lake on Earth?", "Lake Baikal"),
    ("What is the chemical symbol of gold?", "Au"),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong"),
    ("Who discovered penicillin?", "Alexander Fleming"),
    ("Who wrote the novel Don Quixote?", "Miguel de Cervantes"),
    ("Who painted The Starry Night?", "Vincent van Gogh"),
    ("Who created the Python programming language?", "Guido van Rossum"),
    ("In which city were the first modern Olympic Games held?", "Athens"),
    ("What is the largest planet in the Solar System?", "Jupiter"),
    ("How many squares does a chess board have?", "64"),
]

if __name__ == "__main__":
    with open(Path(__file__).with_name("qa.jsonl"), "w") as f:
        for question, answer in QUESTIONS:
            prompt = [{"role": "user", "content": f"{INSTRUCTIONS}\nQuestion: {question}"}]
            f.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
