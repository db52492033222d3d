"""The autograd graph behind a tensor, for tests that check which backward nodes a fast path avoids."""


def backward_nodes(grad_fn, stop=None):
    """The autograd nodes reachable from grad_fn, each once, depth first, not past the node `stop`."""
    nodes, todo, seen = [], [grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node is stop or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo += [next_node for next_node, _ in node.next_functions]
    return nodes
