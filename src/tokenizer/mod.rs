//! Tokenizer, chat templates and streaming detokenization.
