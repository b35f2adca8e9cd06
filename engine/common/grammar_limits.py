"""Structured output's bounds, shared by the API server (which refuses a grammar past them)
and the engine (which follows one under them): plain constants, no imports, so that both
sides and the wire format agree on them without importing each other."""

# llguidance's resource limits, the same where the API server validates a grammar
# and where the engine follows it: its defaults let one hostile grammar (a regex
# like a{100000}) cost tens of ms per token of the engine's loop; past these the
# row's grammar errors and its answer ends there, the rank's other rows unharmed.
GRAMMAR_LIMITS = {
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 50_000,
    "step_max_items": 20_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 100_000,
    "max_items_in_row": 2000,
}
# What the grammars that pass the API server's cost model (daemons/api/guided.py)
# stay under, so they compile and are followed under GRAMMAR_LIMITS (measured
# with llguidance 1.9): alternatives of one rule (each is an item of the parser's
# first row: guided_choice, enum, anyOf), an object's properties (about four items
# each when optional), one lexeme's length with repetitions expanded (a{100000}
# runs the lexer out of fuel; a{10000} is followed), and the grammar's bytes.
MAX_GRAMMAR_ALTERNATIVES = 1900
MAX_GRAMMAR_PROPERTIES_PER_OBJECT = 400  # optional ones
MAX_GRAMMAR_PATTERN_SIZE = 10_000
MAX_GRAMMAR_BYTES = 1 << 20
