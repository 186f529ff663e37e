"""The tasks' environments: multi-hop QA with search (`multihop`), tool-use math (`math_world`,
`calculator`), function calling (`fc_world`), their shared problem worlds and registry of embedded
tasks (`problem_world`, `tool_tasks`)."""
