"""The tool of the calculator task: one typed function, as a user writes it for `env.tools`.

    python -m dataflow.run graphs/agent.py --set env.path=examples/agents/calculator.py \
        --set env.tools=[calculator] ...          (the full command: examples/agents/README.md)

The engine turns the type hints and the docstring into the tool's JSON schema
(transformers.utils.get_json_schema), lists it for the model, parses the model's
`<tool_call>{"name": "calculator", "arguments": {"expression": "345 * 67"}}</tool_call>` and
returns what this function returns (a bad expression raises: the model gets the error back, and
the engine counts it).
"""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / ( ) are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic expression to evaluate, with numbers and + - * / ( ), for example "345 * 67".
    """
    text = str(expression).replace("x", "*").replace("×", "*").replace(",", "").strip().rstrip("=").strip()
    if len(text) > 200:
        raise ValueError("the expression is longer than 200 characters")
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError, RecursionError):
        raise ValueError(f"{text!r} is not an arithmetic expression") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


FORMAT_BONUS = 0.1
"""Reward for an episode that made at least one well-formed calculator call (issue 36: a 135M
model needs a small format bonus to start from, as verl's GSM8K tool example needed +0.1)."""


class CalculatorEnv:
    """The same tool in TRL's environment_factory form (`env.name=CalculatorEnv`; TRL:
    `environment_factory=CalculatorEnv`): its public method is the tool, and get_reward() gives the
    format bonus, which the answer's reward (examples/agents/rewards.py) is added to."""

    def reset(self, **row) -> None:
        self.good_calls = 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: The arithmetic expression to evaluate, with numbers and + - * / ( ), for example "345 * 67".
        """
        value = calculator(expression)
        self.good_calls += 1
        return value

    def get_reward(self) -> float:
        return FORMAT_BONUS if self.good_calls else 0.0
