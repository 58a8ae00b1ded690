"""Tools an agent calls during an episode: each a service that runs beside training (its
own process, or a task on the worker's event loop) and the client the agent uses.
A tool's failure is the episode's information, never the episode's crash: each client
has a call that turns a failure into text for the model."""
