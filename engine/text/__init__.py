"""Text in and out of the model: the tokenizer view, incremental detokenizing and stop strings, grammars for
structured output, and the tool-call format."""
