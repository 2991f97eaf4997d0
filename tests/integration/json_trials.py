"""Twenty varied structured-output requests for the real model: different tasks, schema shapes
(nested objects, arrays, enums, numbers, booleans, optional fields) and temperatures.

Every string, array and number is bounded, as production extraction schemas are: the grammar
then guarantees the JSON closes within max_tokens even when a 135M model starts to repeat
itself (unbounded, it can loop inside a string until the budget runs out)."""

NAME = {"type": "string", "maxLength": 40}
TEXT = {"type": "string", "maxLength": 120}
SHORT_LIST = {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1,
              "maxItems": 4}


def obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "properties": {**required, **(optional or {})},
            "required": list(required), "additionalProperties": False}


TRIALS = [
    ("Describe a fictional person with a name and an age.",
     obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("What is the capital of France? Give the city and country.",
     obj({"city": NAME, "country": NAME})),
    ("List three colours of the rainbow.", obj({"colors": SHORT_LIST})),
    ("Classify the sentiment of: 'I love this product!'",
     obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
          "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("Describe the novel 1984 by George Orwell.",
     obj({"title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1000,
                                                   "maximum": 2100}})),
    ("Is water wet? Answer yes or no with a short reason.",
     obj({"answer": {"type": "boolean"}, "reason": TEXT})),
    ("Give a recipe name and its main ingredients for pancakes.",
     obj({"recipe": NAME, "ingredients": SHORT_LIST})),
    ("Extract the date from: 'The meeting is on 12 March 2024.'",
     obj({"day": {"type": "integer", "minimum": 1, "maximum": 31},
          "month": {"enum": ["January", "February", "March", "April", "May", "June", "July",
                             "August", "September", "October", "November", "December"]},
          "year": {"type": "integer", "minimum": 1900, "maximum": 2100}})),
    ("Translate 'good morning' into Spanish and French.",
     obj({"spanish": NAME, "french": NAME})),
    ("Give the coordinates of a point on a map.",
     obj({"point": obj({"x": {"type": "number", "minimum": -180, "maximum": 180},
                         "y": {"type": "number", "minimum": -90, "maximum": 90}})})),
    ("Create a todo item for buying milk.",
     obj({"task": TEXT, "done": {"type": "boolean"},
          "priority": {"enum": ["low", "medium", "high"]}})),
    ("Name a famous painting and its painter.",
     obj({"painting": NAME, "painter": NAME}, {"year": {"type": "integer", "minimum": 1000,
                                                         "maximum": 2100}})),
    ("Summarise the plot of Romeo and Juliet in one sentence.", obj({"summary": TEXT})),
    ("Give two tips for better sleep.",
     obj({"tips": {"type": "array", "items": TEXT, "minItems": 2, "maxItems": 2}})),
    ("How many legs does a spider have?",
     obj({"animal": NAME, "legs": {"type": "integer", "minimum": 0, "maximum": 1000}})),
    ("Describe a user profile with a username, an email and whether the account is active.",
     obj({"username": NAME, "email": {"type": "string", "maxLength": 60},
          "active": {"type": "boolean"}})),
    ("Rate the movie Inception from 1 to 5 stars with a short review.",
     obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "review": TEXT})),
    ("What are the three states of matter?",
     obj({"states": {"type": "array", "items": {"enum": ["solid", "liquid", "gas", "plasma"]},
                     "minItems": 3, "maxItems": 3}})),
    ("Describe a company with its name, the year it was founded and its employees.",
     obj({"company": NAME, "founded": {"type": "integer", "minimum": 1800, "maximum": 2100},
          "employees": {"type": "array", "maxItems": 3, "items": obj(
              {"name": NAME, "role": {"enum": ["engineer", "manager", "designer"]}})}})),
    ("Give the weather forecast for tomorrow in London.",
     obj({"city": NAME, "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
          "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy", "windy"]}})),
]
TEMPERATURES = [0.0, 0.7, 1.0, 0.3]
