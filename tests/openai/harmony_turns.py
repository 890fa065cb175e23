"""The harmony (gpt-oss) exchange the serve and gateway tests script: one tool, a user's question, the model's turn
that calls the tool and its turn that answers, as the official template writes them after `<|start|>assistant`."""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
NEXT = "<|start|>assistant"
CALLING = ("<|channel|>analysis<|message|>Need the weather.<|end|>" + NEXT
           + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
ANSWERING = ("<|channel|>analysis<|message|>It is sunny there.<|end|>" + NEXT
             + "<|channel|>final<|message|>Sunny in Paris.<|return|>")
