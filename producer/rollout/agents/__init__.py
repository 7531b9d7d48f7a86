"""Black-box agents over an OpenAI-compatible chat-completions API (producer.agent_endpoint;
docs/multi-turn.md "Black-box agents").

    driver.py   AgentEpisodes, the Agents rollout driver: every episode, on the engine's thread
    openai.py   the chat-completions protocol: requests parsed and checked, response and error bodies
    http.py     AgentHttp, the HTTP server: routes, reads and awaits; commands go to the driver

producer/rollout/build.py builds the driver and starts its server (http.py imports driver.py
and openai.py; driver.py imports openai.py only).
"""
