"""The synthetic multi-hop worlds: the traps world (`synthetic_world`, `synthetic_schema`,
`synthetic_traces`, `synthetic_tokenizer`, gathered in `synthetic`) and the many-lessons world
(`lessons_world`)."""
