"""Write math.jsonl: a chat prompt per problem (the code-interpreter instructions plus the problem) and its answer."""

import json
from pathlib import Path

INSTRUCTIONS = (
    "Solve the problem. You can run Python: put code inside <code> and </code> and what it prints comes back "
    "inside <interpreter> and </interpreter>. End with the final answer in \\boxed{}."
)
PROBLEMS = [
    ("What is 12 * 34?", "408"),
    ("What is the sum of the integers from 1 to 100?", "5050"),
    ("What is 2 to the power 20?", "1048576"),
    ("How many prime numbers are smaller than 100?", "25"),
    ("What is the remainder when 7^100 is divided by 13?", "9"),
    ("What is 15 factorial divided by 13 factorial?", "210"),
    ("What is the greatest common divisor of 462 and 1071?", "21"),
    ("What is 1/2 + 1/3 + 1/6?", "1"),
    ("What is 3/8 written as a decimal?", "0.375"),
    ("How many ways can 5 books be arranged on a shelf?", "120"),
]

if __name__ == "__main__":
    with open(Path(__file__).with_name("math.jsonl"), "w") as f:
        for problem, answer in PROBLEMS:
            prompt = [{"role": "user", "content": f"{INSTRUCTIONS}\nProblem: {problem}"}]
            f.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
