"""Scale-out on Ray: engine replicas as Ray actors behind one EngineClient (distributed/client.py),
so a run's reading, validation, commits and output stay the local ones."""
