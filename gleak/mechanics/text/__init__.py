"""The text modality's mechanics: the corpora and their tokenizer (`data`), the text models (`models`) and
ROUGE-based scoring (`metrics`)."""
