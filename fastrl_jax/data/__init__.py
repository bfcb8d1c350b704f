"""Prompts and data: built-in math and chat prompt sets, prompt files and records, chat-template
tokenisation, and the grain pipelines of RL prompts."""
