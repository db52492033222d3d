"""Chapter 2 and 3, the model: BertModel and its parts (embeddings, attention, layers, heads, loss), built from a
model config; no parallel code and no speed lever lives here."""
