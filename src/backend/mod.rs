//! The op set the model forward is written against.
